"""Adam's moments held in bf16 between steps: ``MPPlugin(optimizer_states="bf16")``.

Adam and AdamW keep two moments a parameter (``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` with ``amsgrad``),
8 bytes a parameter in fp32 beside fp32 weights or master weights. With ``optimizer_states="bf16"`` they are held in
bf16 between steps (4 bytes), and each step is the optimizer's own, unchanged::

    outside the step            the step (optimizer.step(), its own class, flags and hyperparameters)
    exp_avg, exp_avg_sq: bf16   pre-hook: each moment of a parameter with a gradient becomes an fp32 copy (exact),
                                the bf16 tensor is let go; torch's Adam/AdamW steps the fp32 values (its fused,
                                foreach or for-loop kernel, as the user chose); post-hook: each moment is rounded back
                                to bf16 stochastically (:func:`lightning_mp.master.stochastic_round`)

Why stochastic rounding: with ``betas[1] = 0.999`` a step moves ``exp_avg_sq`` by 0.1 % of itself, less than half a
bf16 unit in the last place (0.2-0.4 %), so rounding to nearest puts it back where it was: the second moment can grow
but never decay, and the steps of a parameter whose gradients shrink stay too small (torch's fused mixed-precision
kernel and Transformer Engine's bf16 states round to nearest; ``tests/test_optim_states.py`` shows the freeze).
Rounded stochastically the moments are unbiased and decay as in fp32.

What holds as with fp32 states: a skipped step never calls the optimizer (or a fused optimizer skips on the device,
where the fp32 copies round back to themselves and the noise drawn for them is rewound), so moments and step counts
stay bit-identical; checkpoints hold the bf16 tensors (plain tensors); a loaded fp32 state becomes bf16 at once; every
data-parallel rank draws the same noise (one seed), so replicas stay equal; FSDP2's DTensor shards round locally.
The fp32 copies exist only inside the step: its peak holds 8 bytes a moment pair as with fp32 states, forward and
backward 4 bytes less.

Which optimizers: ``torch.optim.Adam`` and ``AdamW`` (and their subclasses), also inside a wrapper (SAM's base
optimizer); anything else is refused before training with the class named (an 8-bit or FP8 optimizer keeps its own
compact state: leave ``optimizer_states="fp32"``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Optional, cast

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.master import STOCHASTIC_ROUNDING_SEED, NoiseGenerators, stochastic_round, wrapped_optimizers
from lightning_mp.settings import OPTIMIZER_STATE_DTYPES

#: the per-parameter state entries held in the chosen dtype: Adam's and AdamW's moments
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: the optimizer classes whose moments are held (subclasses too)
SUPPORTED: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)

_DTensor: Optional[type]
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _is_dtensor(t: Any) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def adam_of(optimizer: Any) -> Optional[Optimizer]:
    """The optimizer whose state holds the moments: ``optimizer`` itself if it is an Adam/AdamW, else the first
    Adam/AdamW it wraps (SAM's ``base_optimizer``); ``None`` where there is none."""
    for candidate in (optimizer, *wrapped_optimizers(optimizer)):
        if isinstance(candidate, SUPPORTED):
            return candidate
    return None


def check_optimizer(optimizer: Any, host: str, name: str) -> Optimizer:
    """The Adam/AdamW whose moments ``optimizer_states=name`` holds, or ``MisconfigurationException`` naming what is
    wrong and what is supported (before training)."""
    adam = adam_of(optimizer)
    cls = type(optimizer).__name__
    if adam is None:
        state = "its momentum buffer" if isinstance(optimizer, torch.optim.SGD) else "its own kind of state"
        raise MisconfigurationException(
            f"{host}(optimizer_states={name!r}) holds the moments of torch.optim.Adam and torch.optim.AdamW (and"
            f" their subclasses), but the run's optimizer is {cls}, which keeps {state}. Use Adam or AdamW, or"
            " optimizer_states='fp32' (the default) with this optimizer. (An optimizer with 8-bit or FP8 state, as"
            " torchao's AdamW8bit, keeps its compact state itself: use it with optimizer_states='fp32'.)"
        )
    for group in adam.param_groups:
        if group.get("differentiable"):
            raise MisconfigurationException(
                f"{host}(optimizer_states={name!r}): {type(adam).__name__}(differentiable=True) differentiates"
                " through its state, which is held in another dtype between steps. Use differentiable=False, or"
                " optimizer_states='fp32'."
            )
        for param in group["params"]:
            if isinstance(param, Tensor) and param.is_complex():
                raise MisconfigurationException(
                    f"{host}(optimizer_states={name!r}): {type(adam).__name__} steps a complex parameter (shape"
                    f" {tuple(param.shape)}); bf16 has no complex dtype. Use optimizer_states='fp32'."
                )
    return adam


class OptimizerStates:
    """The ``optimizer_states`` setting of a run, and the optimizers whose moments it holds.

    Example::

        states = OptimizerStates("bf16")
        undo = states.hold(torch.optim.AdamW(model.parameters()), host="MPPlugin")
        ...                      # each optimizer.step() steps fp32 copies; between steps the moments are bf16
        undo()                   # the optimizer is plain again: its moments fp32, its hooks gone
    """

    def __init__(self, name: str = "fp32", seed: int = STOCHASTIC_ROUNDING_SEED) -> None:
        self.name = name
        #: the dtype the moments are held in between steps (``None``: as the optimizer keeps them)
        self.dtype: Optional[torch.dtype] = OPTIMIZER_STATE_DTYPES[name]
        #: the rounding noise: seeded alike on every rank, so data-parallel replicas round alike; saved in checkpoints
        self.noise = NoiseGenerators(seed)
        self._held: weakref.WeakKeyDictionary[Optimizer, _Held] = weakref.WeakKeyDictionary()

    @property
    def active(self) -> bool:
        """Whether the moments are held in another dtype than the optimizer's own."""
        return self.dtype is not None

    def __getstate__(self) -> dict[str, Any]:  # (a plugin pickles mid-fit: the hooks stay with the optimizers)
        state = dict(self.__dict__)
        state["_held"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._held = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ set-up
    def hold(self, optimizer: Any, host: str) -> Any:
        """Hold ``optimizer``'s moments in :attr:`dtype` from now on (its existing moments are converted now);
        returns what undoes it. Raises ``MisconfigurationException`` for an optimizer this cannot hold."""
        adam = check_optimizer(optimizer, host, self.name)
        if adam in self._held:
            return _nothing
        held = self._held[adam] = _Held(self, adam)
        return held.release

    def held_optimizers(self) -> list[Optimizer]:
        return list(self._held)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain tensors and strings): the dtype and the generators' states."""
        return {"dtype": self.name, **self.noise.state_dict()}

    def load_state_dict(self, state: Optional[dict[str, Any]], host: str) -> None:
        """A checkpoint's entry (``None``: written with fp32 moments, or before this setting existed). Says in one
        line when the checkpoint's moments are held in another dtype (the optimizer's state converts as it loads)."""
        saved = state.get("dtype", "fp32") if isinstance(state, dict) else "fp32"
        if saved != self.name:
            rank_zero_info(
                f"{host}: the checkpoint's optimizer moments are {saved}, training resumes with"
                f" optimizer_states={self.name!r}: converted as the optimizer state loads"
                + (" (exactly)." if self.name == "fp32" else " (rounded to nearest once).")
            )
        if not isinstance(state, dict):
            return
        self.noise.load_state_dict(
            state, "The checkpoint's optimizer-states entry is corrupted: 'generators' is not a dict."
        )


    def compact_checkpoint(self, optimizer_states: Any) -> None:
        """The optimizer states of a Lightning checkpoint (``checkpoint["optimizer_states"]``) with their moments in
        :attr:`dtype`: a checkpoint saved after ``fit`` (whose end gave the optimizer its fp32 moments back) holds
        what one saved during it holds. The moments are new tensors in new dicts: the live optimizer is untouched."""
        dtype = self.dtype
        if dtype is None or not isinstance(optimizer_states, list):
            return
        for opt_state in optimizer_states:
            state = opt_state.get("state") if isinstance(opt_state, dict) else None
            if not isinstance(state, dict):
                continue
            opt_state["state"] = {
                key: {k: v.to(dtype) if k in MOMENTS and _is_fp32(v) else v for k, v in entry.items()}
                if isinstance(entry, dict) else entry
                for key, entry in state.items()
            }


def _is_fp32(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.float32


def _nothing() -> None:
    pass


def _no_optimizer() -> None:
    return None


class _Held:
    """One optimizer whose moments are held in bf16: its step hooks and its load hook."""

    def __init__(self, states: OptimizerStates, optimizer: Optimizer) -> None:
        self.states = states
        self.optimizer: Any = weakref.ref(optimizer)
        self._stepping: list[Tensor] = []  # the parameters the step in progress steps (those with a gradient)
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        self._after_load(optimizer)  # a state loaded before the run (a resume under Fabric, a second fit)

    def __getstate__(self) -> dict[str, Any]:
        # an optimizer pickled or copied mid-fit takes its hooks along: they step its moments as here; the copy is
        # not this run's to release (``release`` does nothing there)
        return {**self.__dict__, "optimizer": _no_optimizer, "_handles": []}

    def release(self) -> None:
        """The optimizer is plain again: hooks removed, its moments fp32 (exact) as torch's Adam makes them."""
        for handle in self._handles:
            handle.remove()
        optimizer = self.optimizer()
        if optimizer is None:
            return
        self.states._held.pop(optimizer, None)
        for _, state, key, value in _moments(optimizer.state.items()):
            if value.dtype == self.states.dtype:
                state[key] = value.float()

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """The moments of the parameters about to be stepped become fp32 copies (the bf16 tensors let go)."""
        self.states.noise.settle()
        stepping = self._stepping = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        dtype = self.states.dtype
        for _, state, key, value in _moments((p, optimizer.state.get(p)) for p in stepping):
            if value.dtype == dtype:
                state[key] = value.float()

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """The moments the step wrote (and those it made, at a parameter's first step) are rounded back
        stochastically."""
        stepping, self._stepping = self._stepping, []
        states, dtype = self.states, self.states.dtype
        assert dtype is not None  # (held only when active)
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None:  # (a fused optimizer stepped with a device verdict: its noise may not count)
            states.noise.before_noise(found_inf)
        for _, state, key, value in _moments((p, optimizer.state.get(p)) for p in stepping):
            if value.dtype == torch.float32:
                state[key] = _rounded(value, dtype, states)

    def _after_load(self, optimizer: Optimizer) -> None:
        """A loaded state (fp32 moments: torch casts them to the parameters' dtype as it loads) is held in the
        run's dtype at once, rounded to nearest (one rounding: nothing to stall)."""
        dtype = self.states.dtype
        for _, state, key, value in _moments(optimizer.state.items()):
            if value.dtype == torch.float32:
                state[key] = value.to(dtype)


def _moments(entries: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, dict, str, Tensor]]:
    """``(param, its state, key, moment)`` for every floating moment in ``entries`` (``(param, state)`` pairs)."""
    for param, state in entries:
        if not isinstance(state, dict):
            continue
        for key in MOMENTS:
            value = state.get(key)
            if isinstance(value, Tensor) and value.is_floating_point():
                yield param, state, key, value


def _rounded(value: Tensor, dtype: torch.dtype, states: OptimizerStates) -> Tensor:
    """fp32 ``value`` rounded to ``dtype`` stochastically (a DTensor shard by shard, each on its own device)."""
    if _is_dtensor(value):
        shard: Any = value
        local = shard.to_local()
        rounded = _round(local, dtype, states.noise.generator(local.device))
        return shard.from_local(
            rounded, shard.device_mesh, shard.placements, run_check=False, shape=shard.shape, stride=shard.stride()
        )
    return _round(value, dtype, states.noise.generator(value.device))


#: moments with at least this many elements on CUDA are rounded by one compiled kernel (reads 4 bytes an element,
#: writes 2, the noise drawn in registers) instead of four eager ones (30 bytes an element); below it a compiled
#: call's host time outweighs the traffic it saves
COMPILED_ROUNDING_MIN_NUMEL = 1 << 20
_COMPILED_ROUNDING: dict[str, Any] = {"fn": None, "failed": None}


def _round_bf16(x: Tensor) -> Tensor:
    # stochastic_round's bf16 branch, written for one fused kernel: 16 random low bits added, then truncated (the
    # bits from a uniform float: Triton draws it in one Philox round, where an integer in a range takes a 64-bit
    # modulo)
    noise = (torch.rand_like(x) * 65536.0).to(torch.int32)
    return (x.view(torch.int32) + noise).bitwise_and(-65536).view(torch.float32).to(torch.bfloat16)


def _round(value: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """:func:`~lightning_mp.master.stochastic_round`, on large CUDA moments in one compiled kernel whose noise comes
    from ``generator`` too (its state lent to the device's default generator for the call: every rank draws the same,
    and a checkpoint or a skip rewinds it as the eager path's)."""
    if (value.is_cuda and dtype is torch.bfloat16 and value.numel() >= COMPILED_ROUNDING_MIN_NUMEL
            and value.is_contiguous() and _COMPILED_ROUNDING["failed"] is None):  # fmt: skip
        default = torch.cuda.default_generators[value.device.index or 0]
        saved = default.get_state()
        try:
            fn = _COMPILED_ROUNDING["fn"]
            if fn is None:
                fn = _COMPILED_ROUNDING["fn"] = torch.compile(_round_bf16, fullgraph=True, dynamic=True)
            default.set_state(generator.get_state())
            rounded = fn(value.view(-1)).view(value.shape)
            generator.set_state(default.get_state())
            return rounded
        except Exception as exc:  # no Triton, a compiler error: the eager kernels round alike
            _COMPILED_ROUNDING["failed"] = exc
        finally:
            default.set_state(saved)
    return stochastic_round(value, dtype, generator)


def moment_bytes(optimizers: Iterable[Any]) -> int:
    """Bytes the moments of ``optimizers`` hold now (each storage once)."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for optimizer in optimizers:
        for _, _, _, value in _moments(getattr(optimizer, "state", {}).items()):
            local = cast(Any, value).to_local() if _is_dtensor(value) else value
            key = (local.untyped_storage().data_ptr(), str(local.device))
            if key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
    return total
