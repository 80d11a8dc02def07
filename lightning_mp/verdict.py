"""The inf/NaN verdict of an optimizer step: the checks that find it, and where a step keeps it.

* :func:`check_grads_` and :func:`check_tensors_`: the read-only passes over gradients (torch's fused kernels);
  :class:`PlannedCheck`: the same for one optimizer whose parameters were looked at once.
* :class:`Verdicts`: one scaler's per-optimizer verdicts, kept where torch's ``GradScaler`` protocol reads them (its
  per-optimizer ``found_inf_per_device``), so that ``step`` skips and ``update`` moves the scale on them. Sources
  (the check, a gradient norm, the master weights' gather, an FP8 saturation flag, the spike guard) are added here,
  not in the scaler. :mod:`lightning_mp.step` owns one and decides which source sets the verdict of a step.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections import defaultdict
from typing import Any, Optional, cast

import torch
from torch.amp.grad_scaler import OptState

_DTensor: Optional[type]
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


#: up to this many gradient elements on a device, the check is torch's fused check-and-unscale kernel with a scale
#: of 1 (one launch, and it rewrites each gradient with itself); above it, the read-only inf-norm pass, which reads
#: the gradients without writing them (half the memory traffic: what counts on large models, whose step is bound by
#: the GPU; above this size their check runs during backward, see lightning_mp.overlap). Below it a step is mostly
#: bound by the host, where one launch beats five and a stack of every gradient's maximum (measured on a 46
#: M-parameter GPT on an H100: benchmarks/RESULTS.md)
FUSED_CHECK_MAX_NUMEL = 1 << 27
_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 device tensor holding ``value``, made once per device (never written: kernels read it, verdicts
    that start from it are copied)."""
    key = (value, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.full((), value, dtype=torch.float32, device=device)
    return tensor


#: where a fused optimizer of a check-only step gets the verdict on the device (``found_inf``) to spare a host sync;
#: elsewhere (the CPU) the host reads the flag for nothing and the optimizer steps without it (tests add "cpu")
DEVICE_VERDICT_TYPES: tuple[str, ...] = ("cuda",)


def takes_device_verdict(optimizer: torch.optim.Optimizer, scaling: bool, device: torch.device) -> bool:
    """Whether ``optimizer`` gets torch's fused protocol (``grad_scale``/``found_inf``): with a loss scale always, as
    torch's scaler; check-only where a device verdict spares a sync (:data:`DEVICE_VERDICT_TYPES`)."""
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    return bool(fused) and (scaling or device.type in DEVICE_VERDICT_TYPES)


def zero_flag(device: torch.device) -> torch.Tensor:
    """A new 0-dim float32 verdict flag (0: nothing found) on ``device``, as torch's check kernels and fused optimizers
    take ``found_inf``. The dtype is named: in manual optimization the step runs inside ``training_step``, where the
    true-half modes make the default dtype half (as Lightning's ``HalfPrecision`` does), and a half flag is refused
    there (``found_inf must be a float tensor``)."""
    return torch.zeros((), dtype=torch.float32, device=device)


def one_flag(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One 0-dim float32 flag on ``device`` from per-device ones (any raised: raised; none: a zero flag), as fused
    optimizers take ``found_inf``."""
    if not flags:
        return zero_flag(device)
    if len(flags) == 1:
        flag = flags[0]
        if flag.dim() == 0 and flag.dtype is torch.float32 and flag.device == device:
            return flag  # (the common case: no dispatcher call)
    flat = [f.reshape(()).float().to(device, non_blocking=True) for f in flags]
    return flat[0] if len(flat) == 1 else torch.stack(flat).amax()


class ZeroFlags:
    """Zeroed 0-dim fp32 flags (a step's inf/NaN verdict), made ``size`` at a time: one allocation and fill for
    ``size`` steps where a step would make its own. A flag is handed out once and never zeroed again, so whatever
    keeps one (the counters, a spike guard's window) keeps its value."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._device: Optional[torch.device] = None
        self._free: list[torch.Tensor] = []

    def take(self, device: torch.device) -> torch.Tensor:
        free = self._free
        if not free or device != self._device:
            self._device = device
            free = self._free = list(torch.zeros(self.size, dtype=torch.float32, device=device).unbind())
            free.reverse()
        return free.pop()


# ---------------------------------------------------------------------- the checks
def check_grads_(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
    """Find inf/NaN among ``optimizer``'s gradients, dividing nothing; returns ``found_inf`` (or a flag per device).

    Large gradients (above :data:`FUSED_CHECK_MAX_NUMEL` elements on a device): ``torch._foreach_norm(grads,
    inf)`` (the fused multi-tensor kernel that gradient clipping uses) gives each gradient's largest magnitude,
    and propagates NaN and inf; unlike ``_amp_foreach_non_finite_check_and_unscale_`` with scale 1 it writes
    nothing back, which halves the memory traffic of the check (measured in benchmarks/RESULTS.md). Small
    ones: that fused kernel with scale 1, one launch instead of five, which is what counts on a model whose
    step is bound by the host (``x * 1`` is ``x`` for every float, so the gradients keep their values).
    """
    planned = _planned(optimizer)
    if planned is not None:
        flags = planned.found_inf(found_inf)
        if flags is not None:
            return flags
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return {}
    if _one_plain_list(grads):  # the common case
        return _check_one_list(grads, found_inf)
    found: dict[torch.device, torch.Tensor] = {}
    for device, (per_dtype, numel) in _grouped_per_device(optimizer).items():
        flag = _flag_on(device, found_inf)
        check_tensors_(per_dtype, numel, flag)
        found[device] = flag
    return found


#: optimizer -> (its parameters when planned, the plan or ``None``): the check of the parameters as they stand in the
#: param groups (a stand-in swap or ``add_param_group`` makes a new plan)
_PLANS: "weakref.WeakKeyDictionary[Any, tuple[list[torch.Tensor], Optional[PlannedCheck]]]"
_PLANS = weakref.WeakKeyDictionary()


def _planned(optimizer: Any) -> Optional["PlannedCheck"]:
    """The :class:`PlannedCheck` of ``optimizer``'s parameters as they are now, planned once while they stay."""
    every = [p for group in optimizer.param_groups for p in group["params"]]
    known = _PLANS.get(optimizer)
    if known is None or len(known[0]) != len(every) or not all(map(operator.is_, known[0], every)):
        try:
            known = _PLANS[optimizer] = (every, PlannedCheck.of(optimizer))
        except TypeError:  # (an object that cannot be weakly referenced: planned for this call alone)
            return PlannedCheck.of(optimizer)
    return known[1]


def _flag_on(device: torch.device, found_inf: torch.Tensor) -> torch.Tensor:
    """``found_inf`` where it lives on ``device``, else a zero flag of its own there."""
    return found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)


def _one_plain_list(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is a plain dense tensor on the first one's device, in its dtype."""
    plain = torch.Tensor
    if not all(type(g) is plain for g in grads) or any(g.is_sparse for g in grads):
        return False
    device, dtype = grads[0].device, grads[0].dtype
    return all(g.device == device and g.dtype == dtype for g in grads)


def _check_one_list(grads: list[torch.Tensor], found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
    """The check of plain gradients of one device and dtype: one call of :func:`check_tensors_`."""
    nonempty = [g for g in grads if g.numel()]
    if not nonempty:
        return {}
    first = nonempty[0]
    flag = _flag_on(first.device, found_inf)
    check_tensors_({first.dtype: nonempty}, sum(g.numel() for g in nonempty), flag)
    return {first.device: flag}


def _local_values(grad: Any) -> torch.Tensor:
    """What a rank checks of a gradient: a sparse one's values, a DTensor's own shard."""
    grad = grad._values() if grad.is_sparse else grad
    if _is_dtensor(grad):
        grad = grad.to_local()  # a rank checks its own shard; the verdict is then all-reduced
    return grad


def _grouped_per_device(
    optimizer: torch.optim.Optimizer,
) -> dict[torch.device, tuple[dict[torch.dtype, list[torch.Tensor]], int]]:
    """``optimizer``'s non-empty gradients per device, then per dtype, with each device's element count."""
    plain = torch.Tensor
    grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    numel: dict[torch.device, int] = defaultdict(int)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if type(grad) is not plain or grad.is_sparse:  # (a plain dense gradient, the common case, skips these)
                grad = _local_values(grad)
            n = grad.numel()
            if n == 0:
                continue  # an empty shard holds nothing to check (and the inf-norm of nothing is undefined)
            grouped[grad.device][grad.dtype].append(grad)
            numel[grad.device] += n
    return {device: (per_dtype, numel[device]) for device, per_dtype in grouped.items()}



_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_NONE = type(None)


class PlannedCheck:
    """The read-only inf/NaN check of one optimizer's gradients, planned from its parameters once.

    Where every parameter is a plain dense tensor on one device (the common case: one dtype; true-half weights
    beside a guard's fp32 ones: one check a dtype), what the check needs to know (the device, the dtypes, the kernel
    for their size) is found here, not on every step; the step then lists the gradients and runs one fused kernel.
    ``None`` from :meth:`of`: the general :func:`check_grads_` applies (several devices, sharded or complex
    parameters). :func:`check_grads_` keeps the plan while the param groups hold the same parameters.
    """

    __slots__ = ("params", "dtype", "numel", "one", "groups")

    def __init__(
        self, params: list[torch.Tensor], dtype: torch.dtype, numel: int,
        groups: Optional[list[tuple[torch.dtype, list[torch.Tensor]]]] = None,
    ) -> None:
        self.params, self.dtype, self.numel = params, dtype, numel
        #: parameters of several dtypes on the one device (true-half weights beside a guard's fp32 ones): per dtype
        self.groups = groups
        device = params[0].device
        #: the scale of 1 of torch's fused check-and-unscale kernel where :func:`check_tensors_` would take it
        fused = numel <= FUSED_CHECK_MAX_NUMEL and (dtype != torch.bfloat16 or device.type != "cuda")
        self.one = constant(1.0, device) if fused else None

    @staticmethod
    def count_of(optimizer: torch.optim.Optimizer) -> int:
        return sum(map(len, map(_PARAMS, optimizer.param_groups)))

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> Optional["PlannedCheck"]:
        # (an empty tensor holds nothing to check)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.numel()]
        if not params:
            return None
        device, dtype = params[0].device, params[0].dtype
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            # (complex is not floating point: complex parameters take the general check)
            if p.device != device or not p.dtype.is_floating_point or p.layout is not torch.strided or _is_dtensor(p):
                return None
            groups.setdefault(p.dtype, []).append(p)
        several = list(groups.items()) if len(groups) > 1 else None
        return cls(params, dtype, sum(p.numel() for p in params), several)

    def found_inf(self, flag: torch.Tensor) -> Optional[dict[torch.device, torch.Tensor]]:
        """Set ``flag`` where a gradient is inf/NaN; ``None`` where a gradient is not what the plan expected (a sparse
        gradient of an ``nn.Embedding(sparse=True)``): the caller takes the general check."""
        if self.groups is not None:
            return self._found_inf_per_dtype(flag)
        grads = list(map(_GRAD, self.params))
        if _NONE in set(map(type, grads)):  # (C passes: no Python a parameter in the common case)
            grads = [g for g in grads if g is not None]
            if not grads:
                return {}
        first = grads[0]
        if (
            first.layout is not torch.strided or first.dtype != self.dtype or type(first) is not torch.Tensor
            or first.device != flag.device
        ):
            return None
        if self.one is not None and not first.requires_grad:  # (gradients of a create_graph backward do)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, self.one)  # check_tensors_'s kernel
        else:
            check_tensors_({self.dtype: grads}, self.numel, flag)
        return {flag.device: flag}


    def _found_inf_per_dtype(self, flag: torch.Tensor) -> Optional[dict[torch.device, torch.Tensor]]:
        """:meth:`found_inf` for parameters of several dtypes: one check of each dtype's gradients."""
        per_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for dtype, params in cast(list, self.groups):
            grads = list(map(_GRAD, params))
            if _NONE in set(map(type, grads)):
                grads = [g for g in grads if g is not None]
            if not grads:
                continue
            first = grads[0]
            if first.layout is not torch.strided or first.dtype != dtype or type(first) is not torch.Tensor \
                    or first.device != flag.device:
                return None
            per_dtype[dtype] = grads
        if per_dtype:
            check_tensors_(per_dtype, self.numel, flag)
        return {flag.device: flag}


def check_tensors_(per_dtype: dict[torch.dtype, list[torch.Tensor]], numel: int, flag: torch.Tensor) -> None:
    """Set ``flag`` (a 0-dim float tensor on the tensors' device) to 1 if any tensor holds an inf or NaN.

    Up to :data:`FUSED_CHECK_MAX_NUMEL` elements in all: torch's fused check-and-unscale kernel with a scale of 1
    (one launch; it rewrites each tensor with itself, bumping its version counter); above: the read-only inf-norm.
    """
    if flag.dtype is not torch.float32:
        raise TypeError(
            f"check_tensors_: the flag is {flag.dtype}; it must be torch.float32 (torch's check kernels and fused"
            " optimizers take no other): make it with verdict.zero_flag(device), not with the default dtype."
        )
    with torch.no_grad():
        rest = []
        for dtype, tensors in _real_views(per_dtype).items():
            # (torch's CUDA kernel takes fp32 and fp16 only; bf16 gradients take the inf-norm there)
            if numel <= FUSED_CHECK_MAX_NUMEL and (dtype is not torch.bfloat16 or flag.device.type != "cuda"):
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, constant(1.0, flag.device))
            else:
                rest.append(tensors)
        if rest:
            worst = [torch.stack(torch._foreach_norm(t, math.inf)).max().float() for t in rest]
            flag.add_(~torch.isfinite(worst[0] if len(worst) == 1 else torch.stack(worst).max()))


def _real_views(per_dtype: dict[torch.dtype, list[torch.Tensor]]) -> dict[torch.dtype, list[torch.Tensor]]:
    """Complex tensors (spectral and FFT models) as real views of the same storage: torch's fused kernels take real
    dtypes only, and a complex number is inf/NaN where a part of it is."""
    if not any(dtype.is_complex for dtype in per_dtype):
        return per_dtype
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, tensors in per_dtype.items():
        if dtype.is_complex:
            tensors = [torch.view_as_real(t) for t in tensors]
            dtype = tensors[0].dtype
        out.setdefault(dtype, []).extend(tensors)
    return out


class _RealGradients:
    """An optimizer's parameter groups as torch's ``_unscale_grads_`` reads them, with complex gradients replaced by
    real views of the same storage (unscaling the view unscales the gradient)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = []
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                grad = param.grad
                if grad is not None and grad.is_complex() and not grad.is_sparse:
                    real = torch.view_as_real(param.detach())
                    real.grad = torch.view_as_real(grad)
                    param = real
                params.append(param)
            groups.append({"params": params})
        self.param_groups = groups


#: optimizer -> (its parameter count, whether any parameter is complex): unscale_ asks on every fp16 step
_COMPLEX: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]]" = weakref.WeakKeyDictionary()


def has_complex_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a parameter (so its gradient) is complex; found once per parameter set, not on every step."""
    count = PlannedCheck.count_of(optimizer)
    known = _COMPLEX.get(optimizer)
    if known is None or known[0] != count:
        known = _COMPLEX[optimizer] = (
            count, any(p.is_complex() for group in optimizer.param_groups for p in group["params"])
        )
    return known[1]


def real_gradients(optimizer: torch.optim.Optimizer) -> "torch.optim.Optimizer | _RealGradients":
    """What torch's ``_unscale_grads_`` should read: the optimizer, or its param groups with real views of complex
    gradients."""
    return _RealGradients(optimizer) if has_complex_grads(optimizer) else optimizer


# ---------------------------------------------------------------------- where a step keeps its verdict
#: the key, in a loss scaler's or the guard's per-optimizer state, of a step's outcome where the host knows it (the
#: step paid torch's one sync): read back by their ``step_outcome``, forgotten with the state
SKIPPED = "skipped_host"


class Verdicts:
    """The inf/NaN verdicts of the optimizer steps a loss scaler (:class:`~lightning_mp.scaling.DynamicLossScaler`) or
    the step guard of the modes without one (:class:`~lightning_mp.nonfinite.NonfiniteGuard`) takes.

    A verdict is a 0/1 float flag per device, kept in the scaler's per-optimizer state (torch's
    ``found_inf_per_device``) from the moment a source sets it until the scale update: ``step`` skips on it, fused
    optimizers get it as ``found_inf``, ``update`` moves the scale on it. The scaler's protocol stage says whether
    a source has set it (``UNSCALED``: the check, or unscaling, ran). No method here syncs with the host.
    """

    __slots__ = ("scaler",)

    def __init__(self, scaler: Any) -> None:  # (a DynamicLossScaler or a NonfiniteGuard; both modules import this one)
        self.scaler = scaler

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """This optimizer's place in torch's protocol since its last step (READY, UNSCALED, STEPPED)."""
        state = self.scaler.optimizer_state(optimizer)
        return OptState.READY if state is None else state["stage"]

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        """This optimizer's step is over (or abandoned); the scale moves once per batch, from the step's verdicts."""
        self.scaler.forget_optimizer(optimizer)

    def found(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """This step's verdict for ``optimizer``, a flag per device (empty: none set)."""
        state = self.scaler.optimizer_state(optimizer)
        return {} if state is None else state["found_inf_per_device"]

    def of(self, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """This step's verdict for ``optimizer`` as one device flag (``None``: none set; valid until the update)."""
        state = self.scaler.optimizer_state(optimizer)
        found = list(state["found_inf_per_device"].values()) if state is not None else []
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).sum()

    def _takeable(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """The optimizer's state where the guard (no loss scale) may take a verdict from a source (none set yet)."""
        scaler = self.scaler
        if not scaler.is_enabled() or scaler.scaling:
            return None
        state = scaler.optimizer_state(optimizer, make=True)
        return state if state["stage"] is OptState.READY else None

    def take_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> bool:
        """The guard (no loss scale): this step's verdict is ``found`` (a 0/1 float flag from a check made elsewhere
        over every gradient the optimizer will apply: the master weights' gather). Returns whether it was taken."""
        state = self._takeable(optimizer)
        if state is None:
            return False
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED
        return True

    def take_total_(self, optimizer: torch.optim.Optimizer, total: torch.Tensor) -> bool:
        """The guard (no loss scale): the verdict from a value computed over every gradient (a total norm), inf/NaN when
        any gradient is (or when finite gradients are so large, beyond ~1e19, that their norm overflows: such a step is
        skipped too). Spares the separate check pass. Returns whether the verdict was taken."""
        if self._takeable(optimizer) is None:
            return False  # (checked first: no flag kernel for a verdict that would not be taken)
        return self.take_(optimizer, (~torch.isfinite(total.detach())).float())

    def add_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor, *, agreed: bool = False) -> None:
        """Fold another finding (a device tensor, > 0 when found) into this step's verdict, after the check.

        For what the gradients cannot show (an inf an FP8 cast saturated into a finite value, a loss spike). The
        verdict stays 0 or 1 (fused optimizers skip on ``found_inf == 1``). Where the scaler's check reduced the
        verdict over the ranks already (the sharded scaler), a flag that is one rank's (``agreed=False``) is reduced
        too, so every rank skips together; ``agreed=True`` for one that is the same on every rank. A disabled scaler
        skips nothing.
        """
        scaler = self.scaler
        if not scaler.is_enabled():
            return
        state = scaler.optimizer_state(optimizer, make=True)
        if state["stage"] is OptState.READY:
            raise RuntimeError("Verdicts.add_() must follow unscale_() (or the check) for this optimizer.")
        bad = (flag.detach().reshape(()) > 0).float()
        if not agreed and scaler.sync_across_ranks and scaler.verdict_agrees_across_ranks:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # enqueued on the device
        found = state["found_inf_per_device"]
        if not found:
            found[bad.device] = bad
            return
        for device, value in found.items():
            value.copy_(torch.maximum(value, bad.to(device, non_blocking=True)).reshape(value.shape))
