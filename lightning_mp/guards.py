"""FP32 guards: run chosen modules (norms, softmax, losses, routers, ...) in fp32 inside a low-precision model.

The guides ask for softmax, losses, LayerNorm/BatchNorm statistics and large reductions in fp32. A guarded
module runs with autocast turned off on fp32 inputs; in true-half modes its parameters and buffers also stay
fp32 (see :func:`lightning_mp.master.cast_module_`) and its outputs go back to the model's dtype.

Example::

    from torch import nn
    from lightning_mp.guards import apply_fp32_guards

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    apply_fp32_guards(model)                       # the default set: ['1'] (the LayerNorm)
    apply_fp32_guards(model, ["defaults", "2"])     # add the last Linear by name: ['1', '2']

Selection (``fp32_modules``) is a list of

* module classes (``nn.LayerNorm``): the module is an instance of one;
* strings, each matched (``fnmatch``-style, case-sensitive) against the module's class name and the names of
  its base classes (``"LayerNorm"``, ``"*BatchNorm*"``, also ``"package.module.ClassName"``), and against its
  fully qualified name in the model or any dotted suffix of it (``"lm_head"`` matches ``model.lm_head``,
  ``"*.router"`` matches ``blocks.3.moe.router``);
* the string ``"defaults"``, which stands for :data:`DEFAULT_FP32_MODULES`.

``None`` means the defaults; an empty list turns the guards off.

Guards applied with :func:`apply_fp32_guards` are the user's: copies and pickles of the model keep them. The guards
a run of ``MPPlugin`` installs (:func:`guard_for_run`) last as long as the run: its teardown removes them from the
module, and the copies of the module made during the run (weight-averaging callbacks, ``torch.save(pl_module)``)
keep only inert ones (the module's own forward, no guard for :func:`fp32_guard_of`), which the next
:func:`apply_fp32_guards` or run removes.

Rule for outputs (modules and the ``fp32_*`` functions alike): under autocast they stay fp32, as autocast's own
fp32 operations return; without autocast (true-half modes) they go back to the 16-bit dtype the inputs came in,
so the next half-precision layer receives what it expects. A guarded module without 16-bit inputs (an
``nn.Embedding`` takes integer indices) hands back the model's compute dtype instead: the default dtype when the
module is called, which MPPlugin's forward context makes the half dtype in true-half modes (in a plain fp32 model
the output stays fp32). Guarded loss modules (a class name ending in ``Loss``; the defaults guard torch's own,
subclasses of ``torch.nn.modules.loss._Loss``) keep fp32 outputs always: a loss feeds backward and logging, not a
half-precision layer.

Inference: under ``torch.inference_mode()`` or ``torch.no_grad()`` nothing is saved for backward, so the guards
only switch dtypes there (see :class:`FP32Guard` for what they save otherwise).

``torch.compile``: while dynamo traces (``torch.compiler.is_compiling()``), guards and the ``fp32_*`` functions
compute the same values with what dynamo can put in one graph: explicit ``.float()`` upcasts and ``.to(dtype)``
downcasts, ``with torch.autocast(device, enabled=False)`` blocks around the guarded forward. Two eager-only parts
are skipped there: the default dtype stays as it is inside the fp32 region (it only matters for tensors a guarded
forward creates without a dtype; dynamo puts ``torch.set_default_dtype`` in the graph, but AOTAutograd does not
apply it to what the graph creates, so the result would depend on the backend), and the saved-activation memory
trick (saved-tensor hooks, which dynamo does not trace; the compiler chooses what backward keeps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

_TORCH_LOSS = "torch.nn.modules.loss._Loss"

DEFAULT_FP32_MODULES: tuple[str, ...] = (
    "*LayerNorm",
    "*RMSNorm",
    "GroupNorm",
    "*BatchNorm*",
    "*InstanceNorm*",
    "LocalResponseNorm",
    "Softmax",
    "Softmin",
    "LogSoftmax",
    "Softmax2d",
    # torch's loss modules, by their base class: a name pattern like "*Loss" would also catch a user's whole
    # model wrapped in a class called e.g. "CaptionLoss" and silently run all of it in fp32
    _TORCH_LOSS,
)
"""The modules kept in fp32 when ``fp32_modules`` is not given (or is ``"defaults"``), as class-name patterns
matched against a module's class and its base classes: the normalization layers (LayerNorm, RMSNorm, GroupNorm,
BatchNorm, InstanceNorm, LocalResponseNorm), softmax and its variants, and every torch loss module (by their base
class ``torch.nn.modules.loss._Loss``). Extend it with ``fp32_modules=["defaults", "lm_head"]``; turn the guards
off with ``fp32_modules=[]``."""

DEFAULTS_TOKEN = "defaults"

#: default entries whose work CUDA autocast already runs in fp32 (layer_norm, group_norm, softmax, log_softmax,
#: the loss functions): under CUDA autocast a hook would only add host time (measured: ~5 ms a step on a small ViT)
AUTOCAST_FP32_ON_CUDA: tuple[str, ...] = (
    "*LayerNorm", "GroupNorm", "Softmax", "Softmin", "LogSoftmax", "Softmax2d", _TORCH_LOSS
)

_LOW = (torch.float16, torch.bfloat16)
_AUTOCAST_DEVICES = ("cpu", "cuda")
_GUARD_ATTR = "_lightning_mp_fp32_guard"

FP32ModuleSpec = Union[str, type]


@dataclass(frozen=True)
class FP32GuardSpec:
    """Which modules run in fp32: class-name / module-name patterns and classes.

    Example::

        spec = FP32GuardSpec.from_arg(["defaults", "*.router", MyNorm])
        spec.matches("blocks.0.moe.router", module)
    """

    patterns: tuple[str, ...] = DEFAULT_FP32_MODULES
    classes: tuple[type, ...] = ()
    #: whether ``fp32_modules`` was given (``None``, the default, leaves it False: the plugin may then adapt the
    #: defaults to the mode, see :meth:`with_native_layer_norm`)
    given: bool = False
    #: whether a plain ``nn.LayerNorm`` that a pattern matches is guarded (see :meth:`with_native_layer_norm`)
    plain_layer_norm: bool = True

    @classmethod
    def from_arg(cls, value: Optional[Sequence[FP32ModuleSpec]]) -> FP32GuardSpec:
        """Build the spec from ``fp32_modules`` (``None``: the defaults; ``[]``: nothing).

        Raises:
            ValueError: for an entry that is neither a non-empty string nor an ``nn.Module`` subclass.
        """
        if value is None:
            return cls()
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(
                f"fp32_modules={value!r} is invalid: use a list of class names, module-name patterns or module"
                f" classes (e.g. ['{DEFAULTS_TOKEN}', '*.router']), [] for none, or null for the defaults."
            )
        patterns: list[str] = []
        classes: list[type] = []
        for entry in value:
            if isinstance(entry, str) and entry.strip():
                entry = entry.strip()
                if entry == DEFAULTS_TOKEN:
                    patterns.extend(p for p in DEFAULT_FP32_MODULES if p not in patterns)
                elif entry not in patterns:
                    patterns.append(entry)
            elif isinstance(entry, type) and issubclass(entry, nn.Module):
                if entry not in classes:
                    classes.append(entry)
            else:
                raise ValueError(
                    f"fp32_modules entry {entry!r} is invalid: use a class name (e.g. 'LayerNorm'), a module-name"
                    f" pattern (e.g. '*.router', 'lm_head'), '{DEFAULTS_TOKEN}', or an nn.Module subclass."
                )
        return cls(tuple(patterns), tuple(classes), given=True)

    @property
    def empty(self) -> bool:
        return not self.patterns and not self.classes

    def without_autocast_fp32(self) -> FP32GuardSpec:
        """The spec less the default entries that CUDA autocast already computes in fp32 (for autocast modes)."""
        patterns = tuple(p for p in self.patterns if p not in AUTOCAST_FP32_ON_CUDA)
        return dataclasses.replace(self, patterns=patterns)

    def with_native_layer_norm(self) -> FP32GuardSpec:
        """The defaults as ``bf16-true`` with master weights uses them: plain ``nn.LayerNorm`` modules are not
        guarded. torch's kernel computes their statistics and affine in fp32 on a bf16 input already; a guard would
        only add fp32 weights (the master weights keep their fp32 values) at the cost of three kernels and autograd
        nodes a LayerNorm where torch runs one. Other normalisations, LayerNorm classes of one's own (whose math may
        run in bf16), softmax and losses stay guarded. A spec given explicitly (``fp32_modules=["defaults"]``
        included) is used as given."""
        return self if self.given else dataclasses.replace(self, plain_layer_norm=False)

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module called ``name`` (its fully qualified name in the model) is guarded."""
        if self.classes and isinstance(module, self.classes):
            return True
        if not self.patterns or (not self.plain_layer_norm and is_plain_layer_norm(module)):
            return False
        suffixes = _dotted_suffixes(name)
        class_names = [n for c in type(module).__mro__ if c not in (nn.Module, object) for n in _class_names(c)]
        matched = [
            pattern for pattern in self.patterns
            if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in (*suffixes, *class_names))
        ]
        if not matched:
            return False
        # a default entry alone picked it, and it computes in fp32 by itself (an RMSNorm that upcasts inside): a
        # guard would add hooks and copies and change nothing (named by anything else, it is guarded as asked)
        return not (all(p in DEFAULT_FP32_MODULES for p in matched) and computes_in_fp32(module))


# --------------------------------------------------------------------------------------------- modules in fp32 already
#: the operators that reduce (statistics, normalisations, softmax): a module computes in fp32 when these and
#: everything before them ran on fp32 tensors
_REDUCTIONS = frozenset({
    "mean", "sum", "var", "var_mean", "std", "std_mean", "linalg_vector_norm", "norm", "amax", "amin", "logsumexp",
    "prod", "cumsum", "_softmax", "_log_softmax", "native_layer_norm", "native_group_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_fused_rms_norm", "rms_norm",
})
_CASTS = frozenset({"_to_copy", "to", "clone", "copy_", "detach", "empty_like", "lift_fresh"})
_FP32_ALREADY: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


class _DtypeLog(TorchDispatchMode):
    """The operators a forward runs, each with the dtypes of its floating-point tensor arguments (casts and views
    left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _CASTS:
            floats = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.is_floating_point()]
            self.ops.append((name, floats))
        return func(*args, **kwargs)


def computes_in_fp32(module: nn.Module) -> bool:
    """Whether ``module`` computes in fp32 by itself: given a 16-bit input and 16-bit weights, it reduces (mean,
    variance, norm, softmax, ...) only fp32 tensors, and nothing before its last reduction runs in 16 bits. LitGPT's
    and Llama's RMSNorm (``x.float()`` first, ``.to(dtype)`` last) and torch's ``nn.RMSNorm`` do; a norm written in
    the input's dtype, torch's LayerNorm, GroupNorm and BatchNorm kernels and softmax on a 16-bit input do not.

    Decided once per class, by running its forward on meta tensors (no memory, no kernel) with an input of the
    module's normalised shape (``normalized_shape``, or its 1-D ``weight``'s); a module without one, with a forward
    of its own on the instance, or whose forward fails on meta tensors counts as not (it stays guarded)."""
    cls = type(module)
    if "forward" in module.__dict__:
        return False
    known = _FP32_ALREADY.get(cls)
    if known is None:
        known = _FP32_ALREADY[cls] = _probe_fp32(module)
    return known


def _probe_fp32(module: nn.Module) -> bool:
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        weight = module._parameters.get("weight")
        shape = tuple(weight.shape) if isinstance(weight, Tensor) and weight.dim() == 1 else None
    if shape is None:
        return False
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    half = torch.bfloat16

    def meta(t: Tensor) -> Tensor:
        return torch.empty(t.shape, dtype=half if t.is_floating_point() else t.dtype, device="meta")

    tensors = {n: meta(t) for n, t in (*module.named_parameters(), *module.named_buffers())}
    log = _DtypeLog()
    try:
        with torch.no_grad(), _reparametrize_module(module, tensors), log:
            type(module).forward(module, torch.empty((2, *shape), dtype=half, device="meta"))
    except Exception:  # e.g. a forward that reads values (.item()) or wants another input shape
        return False
    last = max((i for i, (name, _) in enumerate(log.ops) if name in _REDUCTIONS), default=None)
    if last is None:
        return False
    wide = (torch.float32, torch.float64)
    return all(dtype in wide for _, floats in log.ops[: last + 1] for dtype in floats)


def is_plain_layer_norm(module: nn.Module) -> bool:
    """An ``nn.LayerNorm`` computing what torch's does: its class's forward is ``nn.LayerNorm.forward`` (a subclass
    that changes the forward, or an instance with its own, is not)."""
    return (
        isinstance(module, nn.LayerNorm)
        and type(module).forward is nn.LayerNorm.forward
        and "forward" not in module.__dict__
    )


def _dotted_suffixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))] if name else []


def _class_names(cls: type) -> tuple[str, str]:
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _keeps_fp32_output(module: nn.Module) -> bool:
    return any(c.__name__.endswith("Loss") for c in type(module).__mro__)


# --------------------------------------------------------------------------------------------- regions
def _autocast_enabled() -> bool:
    # (every guarded call asks: the two devices spelled out, no generator)
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


_is_compiling = getattr(torch.compiler, "is_compiling", None)


def _compiling() -> bool:
    """Whether dynamo is tracing this code (``torch.compile``): the guards take their graph-friendly path."""
    return _is_compiling is not None and _is_compiling()


def _autocast_devices() -> tuple[str, ...]:
    """The devices autocast is on for."""
    devices: tuple[str, ...] = ()
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            devices = devices + (device,)
    return devices


# While dynamo traces, autocast is switched off only by plain ``with torch.autocast(device, enabled=False)`` blocks:
# dynamo can neither enter one in a pre-hook and leave it in a forward hook (``__enter__`` called by hand), nor
# trace an ExitStack of them, nor restore ``torch.set_autocast_enabled`` calls correctly when an autocast block
# inside the compiled function encloses them (its end-of-trace restore undoes the block's exit); and AOTAutograd
# drops such a call at run time, so after a graph break the eager rest would run with autocast on.


@contextlib.contextmanager
def fp32_region() -> Iterator[None]:
    """A block of code that runs in fp32: autocast off (on every device) and fp32 as the default dtype.

    Tensors coming in keep their dtype: cast half-precision ones with ``.float()`` inside.

    Example::

        with fp32_region():
            logits = router(x.float())          # fp32 matmul even under bf16 autocast
            probs = logits.softmax(-1)
    """
    if _compiling():  # autocast off only (see the module docstring), in plain with-blocks
        devices = _autocast_devices()
        if "cpu" in devices and "cuda" in devices:
            with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                yield
        elif "cpu" in devices:
            with torch.autocast("cpu", enabled=False):
                yield
        elif "cuda" in devices:
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield
        return
    region = _EagerRegion()
    try:
        yield
    finally:
        region.close()


class _EagerRegion:
    """The eager fp32 region as a plain object: opened in a guard's pre-hook, closed in its forward hook.

    Not a generator: a region that is never closed (a ``KeyboardInterrupt`` inside forward skips torch's
    ``always_call`` hooks; Lightning catches it and the process goes on) is dropped by :meth:`discard` with no side
    effect, where a suspended generator's garbage collection would switch autocast back on at some later moment.
    """

    __slots__ = ("_autocasts", "_dtype", "_hooks", "_upcasts")

    def __init__(self) -> None:
        self._autocasts = [torch.autocast(d, enabled=False) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        for autocast in self._autocasts:
            autocast.__enter__()
        previous = torch.get_default_dtype()
        self._dtype: Optional[torch.dtype] = previous if previous is not torch.float32 else None
        if self._dtype is not None:
            torch.set_default_dtype(torch.float32)
        self._hooks: Optional[Any] = None  # saved-tensor hooks (see keep_originals)
        self._upcasts: Optional[dict] = None

    def keep_originals(self, upcasts: dict[int, tuple[Tensor, int, Tensor, int]]) -> None:
        """Until the region closes, what autograd saves of an fp32 copy in ``upcasts`` is kept as its 16-bit
        original (nothing without grad, or where other saved-tensor hooks are in force)."""
        if not torch.is_grad_enabled() or _saved_tensor_hooks_active():
            return
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*_save_originals(upcasts))
        self._hooks.__enter__()
        self._upcasts = upcasts

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
        self._forget_upcasts()  # the hooks outlive forward (in backward): they must not keep the copies
        if self._dtype is not None:
            torch.set_default_dtype(self._dtype)
        for autocast in reversed(self._autocasts):
            autocast.__exit__(None, None, None)

    def discard(self) -> None:
        """A region whose forward never finished: autocast and the default dtype were put back by the contexts
        around it as they unwound; only our saved-tensor hooks may still be in force (on top: popped)."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if self._hooks is not None and top is not None:
            current = top(False)
            if current is not None and getattr(current[0], "__qualname__", "").startswith("_save_originals"):
                torch._C._autograd._pop_saved_tensors_default_hooks()
        self._hooks = None
        self._forget_upcasts()
        self._autocasts = []

    def _forget_upcasts(self) -> None:
        if self._upcasts is not None:
            self._upcasts.clear()
            self._upcasts = None


def _result_dtype(x: Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    if x.dtype in _LOW and not _autocast_enabled():
        return x.dtype
    return torch.float32 if x.is_floating_point() and x.dtype != torch.float64 else x.dtype


def _up(x: Tensor) -> Tensor:
    return x.float() if x.dtype in _LOW else x


def fp32_softmax(x: Tensor, dim: int, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``softmax(x, dim)`` computed in fp32 (autocast off, input upcast).

    The result is fp32 under autocast and ``x``'s dtype otherwise (true-half), unless ``dtype`` says.

    Example::

        probs = fp32_softmax(scores, dim=-1)      # attention probabilities, then ``probs @ v``
    """
    out = _result_dtype(x, dtype)
    with fp32_region():
        return F.softmax(_up(x), dim=dim).to(out)


def fp32_log_softmax(x: Tensor, dim: int, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``log_softmax(x, dim)`` computed in fp32; result dtype as :func:`fp32_softmax`."""
    out = _result_dtype(x, dtype)
    with fp32_region():
        return F.log_softmax(_up(x), dim=dim).to(out)


def fp32_layer_norm(
    x: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``layer_norm`` with statistics, affine parameters and output computed in fp32.

    Result dtype as :func:`fp32_softmax`.

    Example::

        h = fp32_layer_norm(h, h.shape[-1], self.ln_weight, self.ln_bias)
    """
    out = _result_dtype(x, dtype)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    up = _up(x)
    weight = None if weight is None else weight.float()
    bias = None if bias is None else bias.float()
    if up is x or not _saving_for_backward() or x.is_inference():
        with fp32_region():
            return F.layer_norm(up, shape, weight, bias, eps).to(out)
    region = _EagerRegion()
    try:
        # backward keeps the 16-bit input, not its fp32 copy (the same values): see FP32Guard
        region.keep_originals({id(up): (up, up._version, x, x._version)})
        return F.layer_norm(up, shape, weight, bias, eps).to(out)
    finally:
        region.close()


# --------------------------------------------------------------------------------------------- fused LayerNorm
# A guarded nn.LayerNorm in a true-half model computes layer_norm(x.float(), fp32 weights).to(x.dtype). Eager torch
# writes that as three kernels with fp32 copies of the input, the output and both gradients (torch's CUDA
# layer_norm refuses fp32 weights with a 16-bit input). On CUDA with Triton the same function is compiled once by
# torch.compile into fused kernels that read and write 16 bits and compute in fp32: the same values up to the order
# of the fp32 sums, without the fp32 copies.
_FUSED_LAYER_NORM: dict[str, Any] = {"fn": None, "failed": None}

_has_triton: Callable[[], bool]
try:
    from torch.utils._triton import has_triton as _has_triton  # cached by torch
except ImportError:  # pragma: no cover - a torch without the helper

    def _no_triton() -> bool:
        return False

    _has_triton = _no_triton


def _layer_norm_fp32(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, shape: tuple) -> Tensor:
    return F.layer_norm(x.float(), shape, weight, bias, eps).to(x.dtype)


def fused_layer_norm_available(x: Tensor) -> bool:
    """Whether a guarded LayerNorm on ``x`` runs as one compiled kernel (CUDA, Triton, no earlier failure)."""
    return x.is_cuda and _FUSED_LAYER_NORM["failed"] is None and _has_triton()


def _fused_layer_norm() -> Any:
    fn = _FUSED_LAYER_NORM["fn"]
    if fn is None:
        fn = _FUSED_LAYER_NORM["fn"] = torch.compile(_layer_norm_fp32, fullgraph=True, dynamic=None)
    return fn


#: inputs with fewer elements take the composite upcast instead of the compiled kernel: a call of the compiled
#: function costs ~0.8 ms of host time for forward and backward (measured on an H100, benchmarks/probe_layer_norm.py),
#: which a model this small cannot hide behind the GPU, while the upcast's extra memory traffic is small there. The
#: same size decides, under autocast, where a plain LayerNorm's guard leaves the fp32 computation to autocast
COMPILED_LAYER_NORM_MIN_NUMEL = 1 << 22
#: an entry of ``FP32Guard._open``: a plain LayerNorm under autocast, which runs it in fp32 itself
_AUTOCAST_RUNS_IT: tuple = ()
#: :func:`_layer_norm_shortcut`'s other answer: the fp32 kernel on the 16-bit input
_FP32_KERNEL = "fp32 kernel"


def _layer_norm_shortcut(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """How a plain guarded LayerNorm's call skips the fp32 region (eager, its guard live), if it can:
    :data:`_FP32_KERNEL` outside autocast for a 16-bit input with fp32 weights (:func:`_fused_layer_norm_forward`);
    :data:`_AUTOCAST_RUNS_IT` under autocast for an fp32 input, and on CUDA for a small 16-bit one (autocast keeps
    an fp32 input's layer_norm fp32 and casts a 16-bit one to fp32 on CUDA, the CPU's does not: the region would
    compute the same, and its one gain, keeping a 16-bit input for backward, is small at this size); ``None``: no
    shortcut."""
    if len(args) != 1 or kwargs or not isinstance(args[0], Tensor):
        return None
    x = args[0]
    if not _autocast_enabled():
        return _FP32_KERNEL if FP32Guard._fused_fits(module, x) else None
    small = x.numel() < COMPILED_LAYER_NORM_MIN_NUMEL
    if x.dtype == torch.float32 or (x.dtype in _LOW and x.is_cuda and torch.is_autocast_enabled("cuda") and small):
        return _AUTOCAST_RUNS_IT
    return None


class _UpcastLayerNorm(torch.autograd.Function):
    """``layer_norm(x.float(), fp32 weights).to(x.dtype)`` as one autograd node, without hooks: what the eager guard
    computes (the same kernels, so the same values and gradients), keeping the 16-bit input for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, shape: tuple
    ) -> Tensor:
        out, mean, rstd = torch.native_layer_norm(x.float(), shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        # differentiable ops only: a gradient penalty (WGAN-GP, R1) differentiates this backward again, through
        # layer_norm's own double-backward formula
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], weight is not None and needs[1], bias is not None and needs[2]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), ctx.shape, mean, rstd, weight, bias, mask
        )
        return (None if dx is None else dx.to(x.dtype)), dw, db, None, None


def _fused_layer_norm_forward(self: nn.LayerNorm, input: Tensor) -> Tensor:
    """A guarded LayerNorm on a 16-bit input with fp32 weights, outside autocast (its guard's pre-hook chose this).

    Inputs below :data:`COMPILED_LAYER_NORM_MIN_NUMEL` elements (and torch.func transforms): the composite
    ``layer_norm(x.float(), fp32 weights).to(x.dtype)``, whose autograd nodes are torch's own (no Python in
    backward; it keeps the fp32 copy of the input for backward, at most 16 MB at this size). Larger ones: the
    compiled fp32 kernel on CUDA, else :class:`_UpcastLayerNorm` (it keeps the 16-bit input instead). All three
    compute the same values and gradients."""
    shape = tuple(self.normalized_shape)
    if input.numel() < COMPILED_LAYER_NORM_MIN_NUMEL or _functorch_active():
        return _layer_norm_fp32(input, self.weight, self.bias, self.eps, shape)
    if not fused_layer_norm_available(input):
        return _UpcastLayerNorm.apply(input, self.weight, self.bias, self.eps, shape)
    try:
        return _fused_layer_norm()(input, self.weight, self.bias, self.eps, shape)
    except Exception as err:  # a compiler problem must not stop training: the eager path computes the same
        _FUSED_LAYER_NORM["failed"] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"lightning_mp: the compiled fp32 LayerNorm guard failed ({_FUSED_LAYER_NORM['failed']:.200}); guarded"
            " LayerNorms use the eager upcast from now on (same values, more memory traffic).",
            stacklevel=2,
        )
        return _layer_norm_fp32(input, self.weight, self.bias, self.eps, shape)


class _GuardedForward:
    """The forward of a guarded module: its own forward, run as its guard's pre-hook prepared.

    * eager: the pre-hook opened the fp32 region already; the module's forward runs as is, or, for an
      ``nn.LayerNorm`` whose pre-hook chose it, the compiled fp32 kernel on the 16-bit input;
    * dynamo tracing (``torch.compile``): the module's forward runs inside ``torch.autocast(device,
      enabled=False)`` blocks for the devices the pre-hook found autocast on for: the one way to switch autocast
      off that dynamo keeps right in one graph, across a graph break inside the forward (it re-enters the block
      around the eager rest) and inside an autocast block of the compiled function.

    An object (not a bound method) in the module's ``__dict__``, so pickled and deep-copied models keep it, bound
    to their own copy of the module. ``inner``: a forward the instance had before it was guarded (else its class's).
    """

    __slots__ = ("module", "inner")

    def __init__(self, module: nn.Module, inner: Any = None) -> None:
        self.module = module
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _guarded_forward(self.module, getattr(self, "inner", None), args, kwargs)


_FusedLayerNormForward = _GuardedForward  # its earlier name: models pickled with it still load


def _guarded_forward(module: nn.Module, inner: Any, args: tuple, kwargs: dict) -> Any:
    guard = module.__dict__.get(_GUARD_ATTR)
    if isinstance(guard, FP32Guard) and guard.hookless:
        return _plain_layer_norm(module, guard, args, kwargs)
    return _forward_as_opened(module, guard, inner, args, kwargs)


def _plain_layer_norm(module: nn.Module, guard: FP32Guard, args: tuple, kwargs: dict) -> Any:
    """A plain ``nn.LayerNorm``'s guard, which has no hooks: the common cases call torch's ops directly (outside
    autocast on a 16-bit input with fp32 weights, see :func:`_fused_layer_norm_forward`; under autocast, where
    autocast computes it in fp32 itself), the others run the guard's pre-hook and forward hook here, around the
    forward. No Python runs in backward, and none around the forward but this function. Other pre-hooks of the
    module see its input as it comes (the fp32 copy is made inside), as they did on the fast path before."""
    shortcut = _layer_norm_shortcut(module, args, kwargs) if guard.live and not _compiling() else None
    if shortcut is _FP32_KERNEL:
        return _fused_layer_norm_forward(module, args[0])  # type: ignore[arg-type]
    if shortcut is _AUTOCAST_RUNS_IT:
        return nn.LayerNorm.forward(module, args[0])  # type: ignore[arg-type]  # (autocast runs it in fp32)
    prepared = guard.before(module, args, kwargs)
    if prepared is not None:
        args, kwargs = prepared
    output = None
    try:
        output = _forward_as_opened(module, guard, None, args, kwargs)
    finally:
        cast_back = guard.after(module, args, output)  # (also when the forward raised: the region closes)
    return output if cast_back is None else cast_back


def _forward_as_opened(module: nn.Module, guard: Any, inner: Any, args: tuple, kwargs: dict) -> Any:
    """The module's forward as its guard's pre-hook opened the call (see :class:`_GuardedForward`)."""
    opened = guard._open[-1] if isinstance(guard, FP32Guard) and guard._open else ()
    if opened is None:  # its pre-hook chose the compiled LayerNorm kernel
        return _fused_layer_norm_forward(module, *args, **kwargs)  # type: ignore[arg-type]
    if opened and opened[0] is not None:  # the eager fp32 region is open: 16-bit weights are upcast for the call
        return _with_fp32_tensors(module, inner, args, kwargs)
    devices = opened[1] if opened else ()

    def forward() -> Any:
        if opened:  # dynamo tracing
            return _traced_with_fp32_tensors(module, inner, args, kwargs)
        return inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)

    if not devices:  # no autocast to switch off
        return forward()

    # plain with-blocks, one per device (dynamo keeps a with-block across a graph break, not a loop of them)
    if "cpu" in devices and "cuda" in devices:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return forward()
    if "cpu" in devices:
        with torch.autocast("cpu", enabled=False):
            return forward()
    with torch.autocast("cuda", enabled=False):
        return forward()


# --------------------------------------------------------------------------------------------- 16-bit weights
def _half_tensors(module: nn.Module) -> Optional[list[tuple[dict, str, Tensor]]]:
    """The 16-bit parameters and buffers of a guarded module (and its children), as (dict, key, tensor) slots;
    ``None`` if there are none (the common case: one look at a norm's two parameters)."""
    found: Optional[list[tuple[dict, str, Tensor]]] = None
    for sub in (module,) if not module._modules else module.modules():
        for slots in (sub._parameters, sub._buffers):
            for key, t in slots.items():
                if t is not None and t.dtype in _LOW:
                    if found is None:
                        found = []
                    found.append((slots, key, t))
    return found


def _with_fp32_tensors(module: nn.Module, inner: Any, args: tuple, kwargs: dict) -> Any:
    """The guarded module's forward with its 16-bit parameters and buffers in fp32 for the call.

    They are 16-bit where a module outside the guards shares them (an LM head tied to the embedding, with the head
    guarded: the weight stays half, see :func:`lightning_mp.master.cast_module_`), or where the module was cast to
    half after a true-half run or by the user. Each is swapped for an fp32 copy (``tensor.float()``: autograd takes
    the gradient back to the tensor in its own dtype) and put back when the forward ends, also on an exception; what
    the forward wrote into a copy in place is written back into the tensor: a buffer's copy always (BatchNorm updates
    its running statistics without a version bump; an unchanged value comes back exactly), a parameter's where its
    version counter moved (``nn.Embedding(max_norm=...)``'s renorm).
    """
    half = _half_tensors(module)
    if half is None:
        return inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    copies: dict[int, tuple[Tensor, Optional[int]]] = {}  # id(tensor) -> (fp32 copy, its version when made)
    for slots, key, t in half:
        if id(t) not in copies:  # one copy of a tensor held twice
            copy = t.float()
            copies[id(t)] = (copy, _version(copy))
        slots[key] = copies[id(t)][0]
    try:
        return inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    finally:
        _put_back(half, copies)


def _put_back(half: list[tuple[dict, str, Tensor]], copies: dict[int, tuple[Tensor, Optional[int]]]) -> None:
    written: set[int] = set()
    for slots, key, t in half:
        copy, version = copies[id(t)]
        if slots.get(key) is not copy:
            continue  # the forward assigned something else there: it stands
        slots[key] = t
        if id(t) in written or (t.is_inference() and not torch.is_inference_mode_enabled()):
            continue
        if not isinstance(t, nn.Parameter) or (version is not None and _version(copy) != version):
            with torch.no_grad():
                t.copy_(copy)
            written.add(id(t))


def _traced_with_fp32_tensors(module: nn.Module, inner: Any, args: tuple, kwargs: dict) -> Any:
    """:func:`_with_fp32_tensors` as dynamo traces it (``torch.compile``), in one graph: torch's own
    reparametrization (which dynamo traces) instead of the swap, buffers written back after the forward."""
    half = {name: t for name, t in (*module.named_parameters(), *module.named_buffers()) if t.dtype in _LOW}
    if not half:  # (decided while tracing: nothing in the graph)
        return inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    copies = {name: t.float() for name, t in half.items()}
    with _reparametrize_module(module, copies, tie_weights=True):
        out = inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    with torch.no_grad():
        for name, t in half.items():
            if not isinstance(t, nn.Parameter):
                t.copy_(copies[name])
    return out


def _version(t: Tensor) -> Optional[int]:
    """``t``'s version counter; ``None`` for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


# --------------------------------------------------------------------------------------------- module guards
class _Original:
    """A saved fp32 tensor stood in for by the 16-bit tensor it was upcast from (see :class:`FP32Guard`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _save_originals(upcasts: dict[int, tuple[Tensor, int, Tensor, int]]) -> tuple[Any, Any]:
    def pack(t: Tensor) -> Any:
        entry = upcasts.get(id(t))
        # the very copy, unchanged since it was made from an unchanged original: the original holds its values
        if entry is not None and entry[0] is t and t._version == entry[1] and entry[2]._version == entry[3]:
            return _Original(entry[2])
        return t

    def unpack(packed: Any) -> Tensor:
        return packed.tensor.float() if isinstance(packed, _Original) else packed

    return pack, unpack


def _saving_for_backward() -> bool:
    """Whether the saved-activation trick applies here: autograd records (grad on, not inference mode), eager
    (not dynamo tracing), no torch.func transform (they refuse saved-tensor hooks) and no other saved-tensor hooks
    in force."""
    return (
        not _compiling()  # first: dynamo does not trace is_inference_mode_enabled
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not _functorch_active()
        and not _saved_tensor_hooks_active()
    )


def _functorch_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is running."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (activation checkpointing, CPU offloading) are already in force here."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: leave what the module saves alone
    try:
        return top(False) is not None
    except (RuntimeError, TypeError):
        return True


class _RunMark:
    """What the guards one run installed (:func:`guard_for_run`) share: whether that run is under way.

    A module copied during the run carries the run's guards (they are in its ``__dict__`` and hooks); the copies
    must not outlive the run as guarded modules, which would compute differently from the module (under autocast)
    and look like guards of the user's own to a later run. So every copy refers to this one object:
    ``copy.deepcopy`` keeps it (not copied), a pickle names it by a token that finds it again in this process while
    the run lasts. :meth:`end` (the run's teardown) turns the guards of the module and of every copy inert: they
    compute nothing, :func:`fp32_guard_of` ignores them and the next :func:`apply_fp32_guards` or run removes them.
    Loaded after the run, or in another process, a pickled mark is an ended one.
    """

    __slots__ = ("__weakref__", "live", "token")

    def __init__(self, token: str, live: bool) -> None:
        self.token = token
        self.live = live

    @classmethod
    def start(cls) -> _RunMark:
        mark = cls(uuid.uuid4().hex, live=True)
        _LIVE_RUNS[mark.token] = mark
        return mark

    def end(self) -> None:
        self.live = False
        _LIVE_RUNS.pop(self.token, None)

    def __copy__(self) -> _RunMark:
        return self

    def __deepcopy__(self, memo: dict) -> _RunMark:
        return self

    def __reduce__(self) -> tuple[Callable[[str], _RunMark], tuple[str]]:
        return _run_mark, (self.token,)


#: the marks of the runs under way in this process, by token (a pickled guard finds its run's here)
_LIVE_RUNS: weakref.WeakValueDictionary[str, _RunMark] = weakref.WeakValueDictionary()


def _run_mark(token: str) -> _RunMark:
    """A pickled run mark, loaded: the run's own while it lasts, else an ended one."""
    mark = _LIVE_RUNS.get(token)
    return mark if mark is not None else _RunMark(token, live=False)


class FP32Guard:
    """The forward hooks that run one module in fp32 (installed by :func:`apply_fp32_guards`).

    The pre-hook opens an :func:`fp32_region` and upcasts fp16/bf16 tensors among the arguments; the forward
    hook (``always_call``: it runs even when forward raises) closes the region and, without autocast, casts
    fp32 outputs back to the 16-bit dtype of the inputs.

    Memory: what the module saves for backward of an upcast input (a norm saves its input) is kept as the
    16-bit original, not as the fp32 copy, and upcast again in backward. The values are the same bit for bit
    (the copy was made from them), so gradients do not change; the saved activation takes half the memory.
    (Not done where other saved-tensor hooks are active, e.g. activation checkpointing or CPU offloading: they
    take precedence; nor where nothing is saved, under ``torch.no_grad()`` or ``torch.inference_mode()``, whose
    tensors have no version counter to check.)

    Without a 16-bit input (an ``nn.Embedding``), outputs go back to the default dtype read in the pre-hook, the
    model's compute dtype in true-half modes (see the module docstring).

    Under ``torch.compile`` (dynamo tracing) the pre-hook upcasts with ``.float()``, the module's forward runs in
    ``torch.autocast(device, enabled=False)`` blocks (see :class:`_GuardedForward`), the forward hook downcasts:
    the same values, no graph breaks. Not there: saved-tensor hooks, the default-dtype switch, the separately
    compiled LayerNorm, and autocast off for other pre-hooks and forward hooks of the module (only its forward).

    ``run``: the run that installed the guard (:func:`guard_for_run`); once it ended, the guard is inert (on copies
    of the module made during the run: the run's teardown removed it from the module itself). ``None``: the user's
    guard (:func:`apply_fp32_guards`), kept until the user removes it.
    """

    #: (a class attribute: guards pickled before runs marked theirs load as the user's)
    run: Optional[_RunMark] = None
    #: a plain ``nn.LayerNorm``'s guard works without hooks (:func:`_plain_layer_norm`); (a class attribute: guards
    #: pickled before had hooks)
    hookless: bool = False

    def __init__(self, keep_fp32_output: bool, fused_layer_norm: bool = False, run: Optional[_RunMark] = None) -> None:
        self.keep_fp32_output = keep_fp32_output
        self.run = run
        #: a plain ``nn.LayerNorm`` (its class's forward): outside autocast, on CUDA, a 16-bit input runs
        #: through the compiled fp32 kernel (see :func:`fused_layer_norm_available`); the pre-hook then opens no
        #: fp32 region (``None`` on ``_open``), which tells the forward to run the kernel
        self.fused_layer_norm = fused_layer_norm
        self.handles: list[Any] = []
        #: one entry per open call: ``None`` (the compiled LayerNorm kernel runs), ``(_EagerRegion, (), back)`` (eager
        #: fp32 region) or ``(None, devices, back)`` (dynamo tracing: the forward runs with autocast off on ``devices``)
        #: or ``_AUTOCAST_RUNS_IT`` (a plain LayerNorm under autocast, which runs it in fp32 itself: nothing to do)
        self._open: list[Optional[tuple[Any, ...]]] = []

    @property
    def live(self) -> bool:
        """Whether the guard works: the user's, or its run's under way."""
        run = self.run
        return run is None or run.live

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        run = self.run
        if run is not None and not run.live:  # a copy of a run's guard after the run: the module's own forward
            return None  # (nothing opened: the forward hook and the guarded forward find nothing to do)
        default = torch.get_default_dtype()  # the model's compute dtype (before the fp32 region makes it fp32)
        if _compiling():
            return self._before_compiling(args, kwargs, default)
        # (a guard pickled with hooks, before a plain LayerNorm's guard had none: the same shortcuts)
        shortcut = _layer_norm_shortcut(module, args, kwargs) if self.fused_layer_norm else None
        if shortcut is not None:
            self._open.append(None if shortcut is _FP32_KERNEL else _AUTOCAST_RUNS_IT)
            return None
        low: list[torch.dtype] = []
        upcasts: dict[int, tuple[Tensor, int, Tensor, int]] = {}  # id(fp32 copy) -> (copy, version, original, version)
        saving = _saving_for_backward()  # inference tensors (inference mode) have no version counter

        def up(t: Tensor) -> Tensor:
            if t.dtype in _LOW:
                low.append(t.dtype)
                copy = t.float()
                if saving and not t.is_inference():
                    upcasts[id(copy)] = (copy, copy._version, t, t._version)
                return copy
            return t

        args, kwargs = tree_map_only(Tensor, up, (args, kwargs))
        back = self._output_dtype(low, default)
        region = _EagerRegion()
        if upcasts:
            region.keep_originals(upcasts)
        self._open.append((region, (), back))
        return args, kwargs

    def _before_compiling(self, args: tuple, kwargs: dict, default: torch.dtype) -> tuple[tuple, dict]:
        """The pre-hook as dynamo traces it: plain upcasts; :class:`_GuardedForward` turns autocast off."""
        low: list[torch.dtype] = []

        def up(t: Tensor) -> Tensor:
            if t.dtype in _LOW:
                low.append(t.dtype)
                return t.float()
            return t

        args, kwargs = tree_map_only(Tensor, up, (args, kwargs))
        back = self._output_dtype(low, default)
        self._open.append((None, _autocast_devices(), back))  # the forward runs with autocast off on these
        return args, kwargs

    def _output_dtype(self, low: list[torch.dtype], default: torch.dtype) -> Optional[torch.dtype]:
        """The dtype fp32 outputs go back to (``None``: they stay fp32); read before autocast is switched off."""
        if self.keep_fp32_output or _autocast_enabled():
            return None
        if low:
            return low[0]  # the 16-bit dtype the inputs came in
        return default if default in _LOW else None  # no 16-bit input (integer indices): the model's dtype

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._open:
            return None
        opened = self._open.pop()
        if not opened:  # the fp32 kernel ran (its output is in the input's dtype already), or autocast's own
            return None
        region, _, back = opened
        if region is not None:
            region.close()
        if back is None or output is None:
            return None
        return tree_map_only(Tensor, lambda t: t.to(back) if t.dtype == torch.float32 else t, output)

    @staticmethod
    def _fused_fits(module: nn.Module, x: Tensor) -> bool:
        """Outside autocast (the caller knows): a 16-bit input and fp32 weights on its device."""
        if x.dtype not in _LOW:
            return False
        # (a plain nn.LayerNorm keeps both in _parameters: read there, not through Module.__getattr__, on every call;
        # a parametrized one computes them)
        params = module._parameters
        weight = params["weight"] if "weight" in params else getattr(module, "weight", None)
        bias = params["bias"] if "bias" in params else getattr(module, "bias", None)
        device = x.device
        return (weight is None or (weight.dtype == torch.float32 and weight.device == device)) and (
            bias is None or (bias.dtype == torch.float32 and bias.device == device)
        )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.hookless = False
        while self._open:  # regions a KeyboardInterrupt left open (newest first)
            opened = self._open.pop()
            if opened is not None and opened[0] is not None:
                opened[0].discard()


def guarded_modules(module: nn.Module, spec: Union[FP32GuardSpec, Sequence[FP32ModuleSpec], None] = None) -> list[str]:
    """Fully qualified names of the modules ``spec`` selects in ``module``, outermost only (the root excluded).

    A selected module's children run inside its fp32 region, so they are not listed separately.
    """
    spec = spec if isinstance(spec, FP32GuardSpec) else FP32GuardSpec.from_arg(spec)
    if spec.empty:
        return []
    return _outermost(module, spec.matches)


def _outermost(module: nn.Module, selected: Callable[[str, nn.Module], bool]) -> list[str]:
    """The names of the submodules ``selected`` picks, outermost only, each module once (under its first name).

    A module the model holds under several names (one ``nn.LayerNorm`` object used in two places) is selected by
    any of them: a name pattern that matches its second name guards the one object, wherever it is called.
    """
    names: list[str] = []
    seen: set[int] = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        if not name or id(sub) in seen or any(name.startswith(outer + ".") for outer in names):
            continue
        if selected(name, sub):
            names.append(name)
            seen.add(id(sub))
    return names


def apply_fp32_guards(
    module: nn.Module, spec: Union[FP32GuardSpec, Sequence[FP32ModuleSpec], None] = None
) -> list[str]:
    """Guard the modules ``spec`` selects (``None``: :data:`DEFAULT_FP32_MODULES`), in place; idempotent.

    Each guarded module runs with autocast off on fp32 inputs (see the module docstring for outputs). The
    change is in place, on the submodules themselves, so it survives wrappers such as DDP that discard a
    converted copy. Returns the guarded names (outermost only), e.g. ``['blocks.0.ln1', 'head.loss']``.
    Parameter dtypes are not touched here: :func:`lightning_mp.master.cast_module_` keeps these fp32.

    Example::

        names = apply_fp32_guards(model, ["defaults", "*.router"])
    """
    return _install(module, spec, None)


def _install(
    module: nn.Module, spec: Union[FP32GuardSpec, Sequence[FP32ModuleSpec], None], run: Optional[_RunMark]
) -> list[str]:
    """:func:`apply_fp32_guards`, the new guards marked with ``run`` (``None``: the user's). Inert guards (of a run
    that ended, on a module copied during it) go first: the module is guarded as if they had never been there."""
    _remove_inert_guards(module)
    names = guarded_modules(module, spec)
    for name in names:
        sub = module.get_submodule(name)
        if fp32_guard_of(sub) is not None:
            if not isinstance(sub.__dict__.get("forward"), _GuardedForward):  # pickled before every guard had one
                sub.forward = _GuardedForward(sub, sub.__dict__.get("forward"))
            continue
        inner = sub.__dict__.get("forward")  # a forward set on the instance: called by the guarded one
        fused = inner is None and type(sub).forward is nn.LayerNorm.forward
        guard = FP32Guard(keep_fp32_output=_keeps_fp32_output(sub), fused_layer_norm=fused, run=run)
        sub.forward = _GuardedForward(sub, inner)
        if fused:  # a plain LayerNorm: its forward does the hooks' work (no hooks: Module.__call__'s fast path)
            guard.hookless = True
        else:
            # both first in line: other pre-hooks run inside the fp32 region on fp32 inputs, and other forward
            # hooks see the output as the next layer receives it
            guard.handles = [
                sub.register_forward_pre_hook(guard.before, with_kwargs=True, prepend=True),
                sub.register_forward_hook(guard.after, always_call=True, prepend=True),
            ]
        sub.__dict__[_GUARD_ATTR] = guard
    return names


def remove_fp32_guards(module: nn.Module) -> list[str]:
    """Remove every FP32 guard inside ``module`` (parameters keep their dtype); returns the names unguarded."""
    return [name for name, sub in module.named_modules() if remove_fp32_guard(sub)]


def _remove_inert_guards(module: nn.Module) -> list[str]:
    """Remove the inert guards inside ``module``: those a run installed, on a copy made during the run (see
    :class:`_RunMark`); returns the names unguarded."""
    inert = [name for name, sub in module.named_modules() if _inert(sub.__dict__.get(_GUARD_ATTR))]
    for name in inert:
        remove_fp32_guard(module.get_submodule(name))
    return inert


def _inert(guard: Any) -> bool:
    return isinstance(guard, FP32Guard) and not guard.live


def remove_fp32_guard(sub: nn.Module) -> bool:
    """Remove the FP32 guard on this very module (hooks, its ``forward``, its attribute); whether it had one."""
    guard = sub.__dict__.pop(_GUARD_ATTR, None)
    if not isinstance(guard, FP32Guard):
        return False
    guard.remove()
    forward = sub.__dict__.get("forward")
    if isinstance(forward, _GuardedForward):
        inner = getattr(forward, "inner", None)
        if inner is None:
            del sub.__dict__["forward"]
        else:
            sub.__dict__["forward"] = inner
    return True


def guard_for_run(
    module: nn.Module, spec: Union[FP32GuardSpec, Sequence[FP32ModuleSpec], None] = None
) -> tuple[list[str], Callable[[], None]]:
    """:func:`apply_fp32_guards` for one run: the guarded names, and a callable that removes the guards this call
    installed (guards already there, the user's own, stay).

    The names are every guarded module's, the user's own guards included (outermost only): what runs in fp32, so
    what a true-half run keeps fp32 (:func:`lightning_mp.master.cast_module_`).

    The guards installed share a :class:`_RunMark`: the undo ends it, so the guards that copies of the module made
    during the run carry go inert with the module's own."""
    before = {id(sub) for sub in module.modules() if fp32_guard_of(sub) is not None}
    run = _RunMark.start()
    names = _install(module, spec, run)
    added = [sub for sub in (module.get_submodule(name) for name in names) if id(sub) not in before]
    if before:  # the user's guards: their modules run in fp32 too
        names = _outermost(module, lambda name, sub: fp32_guard_of(sub) is not None)

    def undo() -> None:
        run.end()  # first: the copies' guards go inert even if a removal below fails
        for sub in added:
            if getattr(sub.__dict__.get(_GUARD_ATTR), "run", None) is run:  # (not one the user put there since)
                remove_fp32_guard(sub)

    return names, undo


def fp32_guard_of(module: nn.Module) -> Optional[FP32Guard]:
    """The guard working on this very module, if any (not an inert one: a run's, on a copy, after the run)."""
    guard = module.__dict__.get(_GUARD_ATTR)
    return guard if isinstance(guard, FP32Guard) and (guard.handles or guard.hookless) and guard.live else None
