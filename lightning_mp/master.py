"""Half-precision weights whose updates keep their precision (``bf16-true`` / ``fp16-true``).

An update smaller than half a unit in the last place of a bf16 weight (``2**-9`` of its size) is lost when it is
written into the weight. Four ways to deal with it, chosen with ``MPPlugin(master_weights=...)``:

==============  =====================================================================  ==================
``"fp32"``      fp32 master copies: the optimizer steps the masters (its state is fp32),  2 + 4 bytes/param
                the half weights are refreshed from them after each step; gradients are
                carried into fp32 after every backward (micro-batches accumulate in fp32)
``"kahan"``     a half-precision compensation buffer per parameter holds what rounding    2 + 2 bytes/param
                the updated weight to half precision dropped, and is added back at the
                next step (about 16 significant bits for bf16)
``"stochastic"``  the updated weight is rounded to half precision stochastically:        2 bytes/param
                unbiased, so small updates survive on average
``"none"``      plain half weights, as Lightning's ``bf16-true`` (optimizer state half)   2 bytes/param
``"optimizer"``  the optimizer keeps fp32 masters itself (Transformer Engine's            2 + 4 bytes/param
                ``FusedAdam(master_weights=True)``: one kernel reads the half gradients
                and writes masters and half weights); nothing is attached here
==============  =====================================================================  ==================

(plus the optimizer state: fp32 in the first three, e.g. 8 bytes/param for Adam.) With ``"kahan"`` and
``"stochastic"`` the optimizer steps a transient fp32 copy of each parameter: from ``prepare`` (after backward)
to ``finish`` (after the step) the copy (the stored weight plus its compensation, with an fp32 gradient) takes
the parameter's place in its param group and holds its optimizer state; then the state goes back to the
parameter, so between steps (and in checkpoints) the fp32 state is keyed to the model's own parameters. The
parameters' storage and dtype never change, so autograd's gradient accumulators, and the DDP hooks on them,
stay in place.

Example (a plain loop; :class:`lightning_mp.MPPlugin` does all of this from Lightning's hooks)::

    model = MyModel()
    cast_module_(model, torch.bfloat16, keep_fp32=apply_fp32_guards(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    masters = attach_master_weights(opt, "fp32", module=model)
    for x, y in data:
        loss = F.cross_entropy(model(x.bfloat16()), y)
        loss.backward()
        masters.step(opt)        # grads into fp32, step the fp32 masters, write the bf16 weights
        opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp._host import HostCopy

MASTER_WEIGHT_KINDS: tuple[str, ...] = ("fp32", "kahan", "stochastic", "none", "optimizer")
_HALF = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
#: the stochastic-rounding generator's seed: the same on every rank, so data-parallel replicas round alike
STOCHASTIC_ROUNDING_SEED = 0x5EED


def parse_master_weights(value: object) -> str:
    """Check a ``master_weights`` value; ``True``/``False`` are short for ``"fp32"``/``"none"``.

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # the command line passes strings
        value = value.strip().lower() == "true"
    if isinstance(value, bool):
        return "fp32" if value else "none"
    if isinstance(value, str) and value.strip().lower() in MASTER_WEIGHT_KINDS:
        return value.strip().lower()
    raise ValueError(
        f"master_weights={value!r} is invalid. Accepted values: {', '.join(repr(k) for k in MASTER_WEIGHT_KINDS)},"
        " true (= 'fp32'), false (= 'none'), or null ('fp32' in the true-half modes)."
    )


def cast_module_(module: nn.Module, dtype: torch.dtype, *, keep_fp32: Iterable[str] = ()) -> int:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place, except inside ``keep_fp32``.

    ``keep_fp32`` names submodules (e.g. the FP32 guards from :func:`lightning_mp.guards.apply_fp32_guards`)
    whose parameters and buffers (BatchNorm running statistics included) stay fp32, also where a parameter
    is shared with a cast module. Parameter objects are kept (``param.data`` is replaced), so optimizers made
    before or after see the same objects. Idempotent. Returns the number of tensors cast.
    """
    keep_ids: set[int] = set()
    kept_modules: set[int] = set()
    for name in keep_fp32:
        sub = module.get_submodule(name)
        kept_modules.update(id(m) for m in sub.modules())
        keep_ids.update(id(t) for t in (*sub.parameters(), *sub.buffers()))
    cast = 0
    with torch.no_grad():
        for sub in module.modules():
            if id(sub) in kept_modules:
                continue
            for param in sub.parameters(recurse=False):
                if param.is_floating_point() and id(param) not in keep_ids and param.dtype != dtype:
                    param.data = param.data.to(dtype)
                    if param.grad is not None:
                        param.grad = None  # a gradient of the old dtype cannot stay on the cast parameter
                    keep_ids.add(id(param))  # shared parameters are cast once
                    cast += 1
            for key, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point() and id(buf) not in keep_ids and buf.dtype != dtype:
                    sub._buffers[key] = buf.to(dtype)
                    cast += 1
            if hasattr(sub, "_dtype") and isinstance(getattr(sub, "_dtype"), torch.dtype):
                sub._dtype = dtype  # LightningModule.dtype reports the training dtype, as Lightning's HalfPrecision
    return cast


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
        raise ValueError(f"stochastic_round: dtype={dtype} is not a 16-bit float (use torch.bfloat16 or torch.float16).")
    nearest = x.to(dtype)
    near32 = nearest.float()
    toward = torch.where(near32 > x, torch.full_like(nearest, -float("inf")), torch.full_like(nearest, float("inf")))
    other = torch.nextafter(nearest, toward)
    gap = (other.float() - near32).abs()
    p_other = torch.where(gap > 0, (x - near32).abs() / gap, torch.zeros_like(x))
    draw = torch.rand(x.shape, device=x.device, generator=generator)
    return torch.where(draw < p_other, other, nearest)


def _still_holds(param: Tensor, value: Tensor) -> bool:
    """Whether the half parameter is still ``value`` (its fp32 original) cast: the original may seed its master."""
    return value.shape == param.shape and bool(value.to(param.dtype).eq(param.detach().to(value.device)).all())


class MasterWeights:
    """What keeps the precision of updates to the half-precision parameters of one or more optimizers.

    Subclasses: :class:`FP32MasterWeights`, :class:`KahanCompensation`, :class:`StochasticRounding`. Made with
    :func:`attach_master_weights`. Per optimizer step: ``carry_grads_()`` after each backward, then
    ``prepare(optimizer)`` (fp32 parameters and gradients from here on: unscale, clip, hooks), the optimizer's
    step or its skip, then ``finish(optimizer, skipped=...)``. ``step(optimizer)`` does the three for a plain
    loop.
    """

    kind: str = ""
    #: whether the optimizer steps transient fp32 copies that stand in for the parameters (kahan, stochastic)
    steps_fp32_copies = False

    def __init__(self) -> None:
        self._params: dict[int, nn.Parameter] = {}  # id(half param) -> half param
        self._names: dict[int, str] = {}  # id(half param) -> name in the module
        self._by_optimizer: dict[int, list[int]] = {}  # id(optimizer) -> ids of its half params
        self._prepared: dict[int, list[Any]] = {}  # id(optimizer) -> what prepare() changed
        self._hooked: set[int] = set()
        self.dtype: Optional[torch.dtype] = None

    # ------------------------------------------------------------------ set-up
    def attach(self, optimizer: Optimizer, module: Optional[nn.Module] = None) -> int:
        """Take charge of ``optimizer``'s half-precision trainable parameters (in place); returns how many.

        Parameters keep their place in their param group (and its options); LR schedulers holding the
        optimizer keep working. Attaching the same optimizer twice changes nothing.
        """
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        ids = self._by_optimizer.setdefault(id(optimizer), [])
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if not (isinstance(param, Tensor) and param.dtype in _HALF and param.requires_grad):
                    continue
                if self.dtype is None:
                    self.dtype = param.dtype
                elif param.dtype != self.dtype:
                    raise ValueError(
                        f"master weights: parameters of two half dtypes ({self.dtype} and {param.dtype}) in one run;"
                        " cast the model to one dtype."
                    )
                if param in optimizer.state:
                    raise ValueError(
                        f"master weights must be attached before the optimizer's first step: it already holds"
                        f" half-precision state for {names.get(id(param), 'a parameter')!r}."
                    )
                pid = id(param)
                self._params[pid] = param
                self._names.setdefault(pid, names.get(pid) or f"param.{len(self._names)}")
                params[i] = self._adopt(param)
                if pid not in ids:
                    ids.append(pid)
        if id(optimizer) not in self._hooked:
            self._hook_optimizer(optimizer)
            self._hooked.add(id(optimizer))
        return len(ids)

    def _adopt(self, param: nn.Parameter) -> Tensor:
        """What the optimizer holds instead of ``param`` (by default ``param`` itself)."""
        return param

    def _hook_optimizer(self, optimizer: Optimizer) -> None:
        """Loading an optimizer state casts it to each parameter's dtype: keep it fp32 for the fp32 copies."""
        swaps: list[tuple[list, int, Tensor, Tensor]] = []
        managed = self._by_optimizer.setdefault(id(optimizer), [])

        def before_load(opt: Optimizer, state_dict: dict) -> None:
            for group in opt.param_groups:
                params = group["params"]
                for i, param in enumerate(params):
                    if id(param) in managed:
                        # an fp32 stand-in that allocates nothing: only its dtype and device are read
                        stand_in = torch.empty((), dtype=torch.float32, device=param.device).expand(param.shape)
                        params[i] = stand_in
                        swaps.append((params, i, param, stand_in))

        def after_load(opt: Optimizer) -> None:
            while swaps:
                params, i, param, stand_in = swaps.pop()
                params[i] = param
                if stand_in in opt.state:
                    opt.state[param] = opt.state.pop(stand_in)

        if self.steps_fp32_copies:
            optimizer.register_load_state_dict_pre_hook(before_load)
            optimizer.register_load_state_dict_post_hook(after_load)

    # ------------------------------------------------------------------ the step
    def carry_grads_(self) -> None:
        """After a backward: move half-precision gradients to where the optimizer reads them (fp32 only)."""

    def prepare(self, optimizer: Optimizer) -> None:
        """Before unscaling, clipping and the step: fp32 gradients (and parameters) for ``optimizer``. Idempotent."""
        if id(optimizer) in self._prepared:
            return
        self._prepared[id(optimizer)] = self._prepare(optimizer, self._by_optimizer.get(id(optimizer), []))

    def _prepare(self, optimizer: Optimizer, ids: list[int]) -> list[Any]:
        return []

    def finish(self, optimizer: Optimizer, *, skipped: Optional[bool] = False, found_inf: Optional[Tensor] = None) -> None:
        """After the step: write the half-precision weights.

        Args:
            skipped: ``True`` when the step was skipped (nothing changes), ``False`` when it ran, ``None`` when
                only the device knows (fused optimizers under a loss scaler): then ``found_inf`` says.
            found_inf: a device tensor, non-zero when the step was skipped (used when ``skipped`` is ``None``).
        """
        records = self._prepared.pop(id(optimizer), None)
        if records is None:
            return
        if skipped is None and found_inf is None:
            skipped = False
        self._finish(optimizer, records, skipped, found_inf)

    def _finish(
        self, optimizer: Optimizer, records: list[Any], skipped: Optional[bool], found_inf: Optional[Tensor]
    ) -> None:
        """Write the half weights; ``found_inf``: the device verdict (non-zero: skipped), given when ``skipped`` is
        ``None``."""

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``carry_grads_``, ``prepare``, ``optimizer.step``, ``finish``: one step of a plain training loop."""
        self.carry_grads_()
        self.prepare(optimizer)
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            self.finish(optimizer, skipped=False)

    # ------------------------------------------------------------------ state
    def named_params(self) -> dict[str, nn.Parameter]:
        return {self._names[pid]: p for pid, p in self._params.items()}

    def tensors(self) -> list[Tensor]:
        """The tensors held besides the model's own weights (masters or compensation buffers)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, strings and dicts (``torch.load(weights_only=True)`` reads them)."""
        return {"kind": self.kind, "dtype": _DTYPE_NAMES.get(self.dtype, str(self.dtype))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; a state of another kind is converted through the fp32 values.

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

    def load_fp32_values(self, values: dict[str, Tensor]) -> None:
        """Take the fp32 values of the weights, by parameter name (e.g. from a checkpoint of another kind or of
        a mixed-precision run); names not given keep their state. ``"stochastic"`` has nothing to take."""

    def _check_names(self, saved: dict[str, Any], what: str) -> dict[str, nn.Parameter]:
        if not isinstance(saved, dict):
            raise ValueError(f"master-weights state: '{what}' is a {type(saved).__name__}, not a dict: it is corrupted.")
        params = self.named_params()
        missing = sorted(set(params) - set(saved))
        unknown = sorted(set(saved) - set(params))
        if missing or unknown:
            raise ValueError(
                f"master-weights state does not fit this model: {what} missing for {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}{' ...' if len(unknown) > 5 else ''}."
                " The checkpoint was written for another model or optimizer set-up."
            )
        for name, tensor in saved.items():
            if not isinstance(tensor, Tensor) or tensor.shape != params[name].shape:
                got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(
                    f"master-weights state: {what} of {name!r} is {got}, the parameter is {tuple(params[name].shape)}."
                )
        return params


class FP32MasterWeights(MasterWeights):
    """fp32 master copies that the optimizer steps; half weights are refreshed from them after each step."""

    kind = "fp32"

    def __init__(self, initial: Optional[dict[int, Tensor]] = None) -> None:
        """``initial``: fp32 values the half parameters had before they were cast (by ``id`` of the parameter),
        so the masters start from the exact fp32 weights instead of their half-precision rounding."""
        super().__init__()
        self._masters: dict[int, nn.Parameter] = {}  # id(half param) -> fp32 master
        self._initial: dict[int, Tensor] = dict(initial or {})

    def _adopt(self, param: nn.Parameter) -> Tensor:
        master = self._masters.get(id(param))
        if master is None:
            value = self._initial.pop(id(param), None)
            if value is None or not _still_holds(param, value):
                # no fp32 original, or the weight changed since it was cast
                master = nn.Parameter(param.detach().to(torch.float32, copy=True))
            else:
                # the original itself becomes the master (no copy where it already sits on the device): set-up needs
                # no more memory than fp32 copies made from the half weights would
                master = nn.Parameter(value.to(device=param.device, dtype=torch.float32))
            self._masters[id(param)] = master
        return master

    def master_of(self, param: nn.Parameter) -> Optional[nn.Parameter]:
        """The fp32 master of a model parameter (``None`` if it has none, e.g. inside an FP32 guard)."""
        return self._masters.get(id(param))

    def carry_grads_(self) -> None:
        # fp32 accumulation across micro-batches: each backward's half gradient is added into the fp32 one
        acc_dst: list[Tensor] = []
        acc_src: list[Tensor] = []
        for pid, master in self._masters.items():
            param = self._params[pid]
            grad = param.grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            elif grad.is_sparse or master.grad.is_sparse:
                master.grad = master.grad + grad.to(torch.float32)
            else:
                acc_dst.append(master.grad)
                acc_src.append(grad)
            param.grad = None
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)

    def broadcast_(self, src: int = 0) -> None:
        """Give every rank ``src``'s masters (DDP broadcasts the weights of rank 0 when it wraps the model: masters
        started from each rank's own fp32 weights must follow, or the ranks would drift apart)."""
        for master in self._masters.values():
            torch.distributed.broadcast(master.data, src=src)

    def all_reduce_grads_async(self) -> tuple[list[Tensor], list[Any]]:
        """Start summing the fp32 gradients over the ranks (async; :meth:`wait_all_reduce` averages them).

        For gradient accumulation under DDP: micro-batches DDP does not reduce (``no_sync``) are accumulated here
        in fp32 on each rank, then reduced in fp32 while the last micro-batch runs its backward. Every master takes
        part (a zero gradient where a rank has none), in the same order on every rank.
        """
        grads = []
        for master in self._masters.values():
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            grads.append(master.grad)
        works = [torch.distributed.all_reduce(g, async_op=True) for g in grads]
        return grads, works

    @staticmethod
    def wait_all_reduce(pending: tuple[list[Tensor], list[Any]], world_size: int) -> None:
        grads, works = pending
        for work in works:
            work.wait()
        if grads and world_size > 1:
            torch._foreach_div_(grads, float(world_size))  # DDP averages: so do these

    def _prepare(self, optimizer: Optimizer, ids: list[int]) -> list[Any]:
        self.carry_grads_()  # gradients from a backward that bypassed the plugin
        return [(self._params[pid], self._masters[pid]) for pid in ids if self._masters[pid].grad is not None]

    def _finish(
        self, optimizer: Optimizer, records: list[Any], skipped: Optional[bool], found_inf: Optional[Tensor]
    ) -> None:
        if skipped is True or not records:
            return
        # on a step skipped on the device the masters did not move: the copy writes the same values
        with torch.no_grad():
            torch._foreach_copy_([p.data for p, _ in records], [m.data for _, m in records])

    def tensors(self) -> list[Tensor]:
        return list(self._masters.values())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["masters"] = {self._names[pid]: m.detach() for pid, m in self._masters.items()}
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        saved = state.get("masters")
        self._check_names(saved, "masters")
        self.load_fp32_values(saved)

    def load_fp32_values(self, values: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for pid, master in self._masters.items():
                name = self._names[pid]
                if name in values:
                    master.copy_(values[name])


class KahanCompensation(MasterWeights):
    """Half weights plus a half-precision buffer holding each weight's rounding error, added back at the next step."""

    kind = "kahan"
    steps_fp32_copies = True

    def __init__(self) -> None:
        super().__init__()
        self._comp: dict[int, Tensor] = {}

    def _adopt(self, param: nn.Parameter) -> Tensor:
        if id(param) not in self._comp:
            self._comp[id(param)] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return param

    def _prepare(self, optimizer: Optimizer, ids: list[int]) -> list[Any]:
        return _swap_in_fp32_copies(optimizer, self._params, ids, self._comp)

    def _finish(
        self, optimizer: Optimizer, records: list[Any], skipped: Optional[bool], found_inf: Optional[Tensor]
    ) -> None:
        _swap_back(optimizer, records)
        if skipped is True:
            return
        params = [param for _, _, param, _ in records]
        values = [value for _, _, _, value in records]
        comps = [self._comp[id(param)] for param in params]
        with torch.no_grad():
            if found_inf is None:
                torch._foreach_copy_(params, values)  # the value rounded to half precision
                torch._foreach_sub_(values, params)  # exact in fp32: the value and its rounding are within an ulp
                torch._foreach_copy_(comps, values)
                return
            skip = found_inf.reshape(()).ne(0)  # skipped on the device: keep both as they were
            for param, value, comp in zip(params, values, comps):
                new = value.to(param.dtype)
                err = value.sub_(new).to(param.dtype)
                param.copy_(torch.where(skip, param, new))
                comp.copy_(torch.where(skip, comp, err))

    def tensors(self) -> list[Tensor]:
        return list(self._comp.values())

    def compensation_of(self, param: nn.Parameter) -> Optional[Tensor]:
        """The compensation buffer of a model parameter (``None`` if it has none)."""
        return self._comp.get(id(param))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["compensation"] = {self._names[pid]: c for pid, c in self._comp.items()}
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        saved = state.get("compensation")
        self._check_names(saved, "compensation")
        with torch.no_grad():
            for pid, comp in self._comp.items():
                comp.copy_(saved[self._names[pid]])

    def load_fp32_values(self, values: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for pid, comp in self._comp.items():
                name = self._names[pid]
                if name in values:
                    param = self._params[pid]
                    comp.copy_(values[name].to(param.device, torch.float32) - param.float())


class StochasticRounding(MasterWeights):
    """Half weights only; each updated weight is rounded to half precision stochastically."""

    kind = "stochastic"
    steps_fp32_copies = True

    def __init__(self, seed: int = STOCHASTIC_ROUNDING_SEED) -> None:
        super().__init__()
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        # a step a fused optimizer may have skipped on the device: the generators' states before its noise was
        # drawn, and its verdict on its way to the host; rewound once the verdict is read (next step, or a save)
        self._pending: Optional[dict[str, Tensor]] = None
        self._verdict = HostCopy()  # the pending step's verdict, on its way to the host

    def generator(self, device: torch.device) -> torch.Generator:
        """The rounding noise's generator on ``device`` (seeded with ``seed``; saved in checkpoints)."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _prepare(self, optimizer: Optimizer, ids: list[int]) -> list[Any]:
        return _swap_in_fp32_copies(optimizer, self._params, ids, None)

    def _finish(
        self, optimizer: Optimizer, records: list[Any], skipped: Optional[bool], found_inf: Optional[Tensor]
    ) -> None:
        _swap_back(optimizer, records)
        if skipped is True:
            return
        self._settle()
        if skipped is None and found_inf is not None:
            # skipped on the device: the copy still holds the old weight exactly, which rounds to itself, but the
            # noise drawn for it must not count: remember the generators' states (host values, no sync) and rewind
            # them when the verdict, copied to the host without waiting, says the step was skipped
            self._pending = {k: g.get_state() for k, g in self._generators.items()}
            self._verdict.start(found_inf.reshape(()).ne(0))
        with torch.no_grad():
            for _, _, param, value in records:
                param.copy_(stochastic_round(value, param.dtype, self.generator(param.device)))

    def _settle(self) -> None:
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
        self._settle()
        state = super().state_dict()
        state["seed"] = self.seed
        state["generators"] = {key: g.get_state() for key, g in self._generators.items()}
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        self._pending = None
        generators = state.get("generators", {})
        if not isinstance(generators, dict):
            raise ValueError("master-weights state: 'generators' is not a dict: it is corrupted.")
        self.seed = int(state.get("seed", self.seed))
        for key, gen_state in generators.items():
            device = torch.device(key)
            if device.type == "cuda" and not torch.cuda.is_available():
                continue
            self.generator(device).set_state(gen_state)


def _swap_in_fp32_copies(
    optimizer: Optimizer, params: dict[int, nn.Parameter], ids: list[int], comp: Optional[dict[int, Tensor]]
) -> list[Any]:
    """Put an fp32 copy (plus compensation, with an fp32 gradient) in the place of each half parameter with a
    gradient, moving its optimizer state along. Returns ``(param list, index, parameter, copy)`` records."""
    managed = set(ids)
    records = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            group_params = group["params"]
            for i, param in enumerate(group_params):
                if id(param) not in managed or param.grad is None:
                    continue
                value = param.detach().to(torch.float32, copy=True)
                if comp is not None:
                    value.add_(comp[id(param)])
                copy = nn.Parameter(value)
                copy.grad = param.grad.to(torch.float32)
                param.grad = None
                group_params[i] = copy
                if param in optimizer.state:
                    optimizer.state[copy] = optimizer.state.pop(param)
                records.append((group_params, i, param, copy))
    return records


def _swap_back(optimizer: Optimizer, records: list[Any]) -> None:
    """Give the parameters their places and their optimizer state back (the copies keep their values)."""
    for group_params, i, param, copy in records:
        group_params[i] = param
        if copy in optimizer.state:
            optimizer.state[param] = optimizer.state.pop(copy)
        copy.grad = None


def fp32_values(state: dict[str, Any], params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The fp32 weights a master-weights state stands for, by parameter name (``params``: the current weights)."""
    kind = state.get("kind")
    if kind == "fp32" and isinstance(state.get("masters"), dict):
        return dict(state["masters"])
    if kind == "kahan" and isinstance(state.get("compensation"), dict):
        return {
            name: params[name].detach().float() + comp.to(params[name].device, torch.float32)
            for name, comp in state["compensation"].items()
            if name in params and isinstance(comp, Tensor) and comp.shape == params[name].shape
        }
    return {}


_KINDS = {"fp32": FP32MasterWeights, "kahan": KahanCompensation, "stochastic": StochasticRounding}


def attach_master_weights(
    optimizers: Union[Optimizer, Sequence[Optimizer]],
    kind: str = "fp32",
    *,
    module: Optional[nn.Module] = None,
    existing: Optional[MasterWeights] = None,
) -> Optional[MasterWeights]:
    """Make ``optimizers`` keep the precision of their half-precision parameters' updates, in place.

    Call it after the model is cast to half precision and the optimizers are made, before their first step.
    ``module`` gives the parameters their names (for checkpoints). ``existing`` (of the same kind) is reused,
    so fp32 masters made earlier for the same parameters keep their low bits. Returns ``None`` for ``"none"``
    and ``"optimizer"``.

    Example::

        masters = attach_master_weights(optimizer, "kahan", module=model)
    """
    kind = parse_master_weights(kind)
    if kind in ("none", "optimizer"):
        return None  # plain half weights, or an optimizer that keeps its own masters
    masters = existing if existing is not None and existing.kind == kind else _KINDS[kind]()
    for optimizer in [optimizers] if isinstance(optimizers, Optimizer) else optimizers:
        masters.attach(optimizer, module)
    if isinstance(masters, FP32MasterWeights):
        masters._initial.clear()  # fp32 originals of parameters no optimizer holds are not kept alive
    return masters


def keeps_own_masters(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` keeps fp32 master weights of half-precision parameters itself.

    Transformer Engine's and Apex's ``FusedAdam(master_weights=True)`` say so with a ``master_weights``
    attribute; a LightningOptimizer is looked through.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return getattr(optimizer, "master_weights", False) is True


def seed_optimizer_masters(optimizer: Optimizer, initial: dict[int, Tensor]) -> int:
    """Start the masters of an optimizer that keeps its own (:func:`keeps_own_masters`) from the exact fp32 weights.

    ``initial`` maps ``id(param)`` to the fp32 value the half parameter had before it was cast. Uses Transformer
    Engine's ``FusedAdam`` API (``initialize_state``/``set_scaled_state``); optimizers without it, or storing
    its masters as 16-bit remainders of the half weights, start from the half weights (returns 0). Returns how
    many masters were seeded.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    init = getattr(optimizer, "initialize_state", None)
    set_state = getattr(optimizer, "set_scaled_state", None)
    if not (callable(init) and callable(set_state)) or getattr(optimizer, "store_param_remainders", False):
        return 0
    seeded = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            value = initial.get(id(param))
            if value is None or param.dtype not in _HALF or not _still_holds(param, value):
                continue  # no fp32 original, or the weight changed since it was cast: its own value is the truth
            if not optimizer.state.get(param):
                init(param, False)
            set_state(param, "master_param", value.to(device=param.device, dtype=torch.float32))
            seeded += 1
    return seeded
